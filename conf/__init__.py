# The main job's Hydra configs. The wheel installs this folder as the package ``lightning_mics.app.conf``
# (pyproject.toml maps it), and the app finds it through Hydra's search path ``pkg://lightning_mics.app.conf``,
# so an installed package runs from any folder. This file only makes the folder an importable package.
