"""The memory-budget search: the fastest schedule that fits a budget per device.

- `jpipe.search.engine`: stage profiles, bytes per device as each lowering
  allocates them, the built-ins and the local search over memory actions
  (`search_schedule`, also ``jpipe.search_schedule``);
- `jpipe.search.cli`: ``python -m jpipe.search``.
"""
