"""The Lightning front ends: the Trainer strategy and the Fabric strategy, what both share (ranks,
devices, engine construction), clipping, precision plugins, failures, layer sync, weight averaging."""
