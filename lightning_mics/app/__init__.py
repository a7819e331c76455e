"""The main job, apart from the engine: a Hydra entry point (``train``), the example models (``models``),
a byte-level corpus (``data``) and the end-of-run report (``report``).

    lightning-mics-train                 # = python -m lightning_mics.app.train

The engine (``lightning_mics`` itself) never imports this package; it depends on the engine only through
the public API (``lightning_mics.MiCSStrategy``, ``lightning_mics.MiCSConfig``). Its Hydra configs are the
repository's top-level ``conf/``, which the wheel carries as ``lightning_mics.app.conf`` (see pyproject.toml).
"""
