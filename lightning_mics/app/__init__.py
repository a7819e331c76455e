"""The main job, apart from the engine: a Hydra entry point (``train``), the example models (``models``),
a byte-level corpus (``data``), the end-of-run report (``report``) and a sweep's comparison (``sweep``), the
structured configs and the checks done before any rank starts (``schema``; ``keys``: the key a misspelled one
meant), ``--help`` written from the configs (``help``), the Lightning callbacks that keep progress (``callbacks``:
periodic ``last.ckpt``, Ctrl-C) and the Hydra callbacks (``runs``: a new folder per job, the sweep's comparison at
its end).

    lightning-mics-train                 # = python -m lightning_mics.app.train

The engine (``lightning_mics`` itself) never imports this package; it depends on the engine only through
the public API (``lightning_mics.MiCSStrategy``, ``lightning_mics.MiCSConfig``). Its Hydra configs are the
repository's top-level ``conf/``, which the wheel carries as ``lightning_mics.app.conf`` (see pyproject.toml).
"""
