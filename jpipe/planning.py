"""The planner's earlier name: `jpipe.planning` is `jpipe.planner` (every public name)."""

from jpipe.planner import *  # noqa: F403
from jpipe.planner import __all__  # noqa: F401
