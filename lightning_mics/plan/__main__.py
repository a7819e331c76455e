"""``python -m lightning_mics.plan --help``: the planner's command line (see ``lightning_mics.plan.cli``)."""

import sys

from lightning_mics.plan.cli import main

sys.exit(main())
