"""The engine: units gathered and released on a schedule, gradients reduced and accumulated, the optimizer's
rows, activation checkpointing, full state, and what user code sees of parameters between steps."""
