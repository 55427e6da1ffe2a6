"""``python -m jpipe.plan``: the cluster planner's command line (`jpipe.planner.cli`)."""

import sys

from jpipe.planner.cli import main
from jpipe.runtime.console import run_main

if __name__ == "__main__":
    sys.exit(run_main(main))
