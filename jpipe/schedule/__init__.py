"""The schedule layer: the language, its checks, and what a schedule costs.

Pure Python, no JAX and no devices. The data flows through it one way:

- `jpipe.schedule.actions`: the actions (`F`, `B`, `I`, `W`, `Overlap`, the
  memory actions) and `Schedule`, written in Python or read from PyTorch's CSV;
- `jpipe.schedule.registry`: schedules by name (`get_schedule`,
  `register_schedule`, ``file.py:function``);
- `jpipe.schedule.events`: the event engine (`Costs`, one timeline of every
  action) under both the validator's memory check and the simulator;
- `jpipe.schedule.validate`: every check, and the dependency analysis kept on
  the validated schedule for the passes after it;
- `jpipe.schedule.simulate`: step time, bubble and bytes per rank;
- `jpipe.schedule.chart`: the timeline drawn as text, PNG or SVG.

Users import these names from `jpipe`; tests and new passes may import the
modules here.
"""
