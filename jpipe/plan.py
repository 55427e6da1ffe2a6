"""``python -m jpipe.plan``: the cluster planner's command line (`jpipe.planner._cli`)."""

import sys

from jpipe.planner._cli import main

if __name__ == "__main__":
    sys.exit(main())
