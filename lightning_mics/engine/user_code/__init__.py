"""User code between steps: what the engine reconciles for code that runs while a unit lends it plain parameters
(``boundary.py``: the events the core reports and the contract; ``write_back.py``: parameters written by user code;
``mirrored_grads.py``: the optimizer's gradients on plain parameters; ``optimizer_watch.py``: how the engine hears of
optimizer steps)."""
