"""``python -m jpipe.search``: see `jpipe.search.cli`."""

import sys

from jpipe.runtime.console import run_main
from jpipe.search.cli import main

if __name__ == "__main__":
    sys.exit(run_main(main))
