"""``python -m jpipe.plan``: the cluster planner's command line (`jpipe.planner._cli`)."""

import sys

from jpipe._console import run_main
from jpipe.planner._cli import main

if __name__ == "__main__":
    sys.exit(run_main(main))
