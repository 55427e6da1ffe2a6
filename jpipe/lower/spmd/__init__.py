"""The SPMD lowering: every rank runs one program in lock step.

- `jpipe.lower.spmd.ticks`: the tick plan (`make_tick_plan`): the schedule as
  lock-step ticks, buffer slots and the table each rank reads;
- `jpipe.lower.spmd.program`: the program of one step (`build_step`), its
  control and its memory actions;
- `jpipe.lower.spmd.lowering`: `SpmdLowering`, the one place that jits it;
- `jpipe.lower.spmd.bytes`: what every device holds: the largest rank's
  terms, and the tick buffers the program sizes.
"""
