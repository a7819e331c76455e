"""``python -m lightning_mics.plan --help``: the planner's command line (see ``lightning_mics.plan.main``)."""

import sys

from lightning_mics.plan import main

sys.exit(main())
