"""The profiler: what F, I and W of each stage cost on one device.

For each stage of a cut model, on one microbatch and one device, the very
pieces jpipe runs (`jpipe.StageKernels`):

- ``F``: the stage's forward, returning its output and the residuals its
  backward needs (less those that are inputs already);
- ``I``: the input-gradient piece, with the cotangent chain through the stage
  (for the first stage, which has no input gradient, the chain alone);
- ``W``: the weight-gradient piece, from the residuals and what ``I`` carries;
- ``B``: ``I`` then ``W`` in one program, the backward of a schedule that
  does not split it.

`stage_programs` compiles the pieces once; the caller times them together
with the rows they predict (`bench.measure.time_together`), so that the costs
and the steps they are compared with come from the same minutes of a shared
machine, and `costs_from_times` turns the medians into per-stage costs for
`jpipe.Costs`.
"""

from __future__ import annotations

import jpipe
from bench import measure
from jpipe.stage.pieces import stage_pieces

# Calls of a piece per timed run (see `stage_programs`).
REPEAT = 4


class _Repeated:
    """Calls a compiled piece `times` times per timed run, so dispatch overlaps execution."""

    def __init__(self, fn, times: int):
        self.fn, self.times = fn, times

    def __call__(self, *args):
        return [self.fn(*args) for _ in range(self.times)]


def stage_programs(
    stage_fns, params_list, microbatch, device, tag, repeat: int = REPEAT
) -> list[measure.Compiled]:
    """The compiled F, B and I pieces of every stage, named ``(tag, stage, kind)``.

    Args:
      stage_fns, params_list: the cut model.
      microbatch: one microbatch's inputs (host arrays).
      device: where to run.
      tag: the first element of every program's name, e.g. the stage count.
      repeat: calls of the piece per timed run (the time is divided by it):
        small pieces cost less than JAX's dispatch of one call, and calling
        again before waiting hides the dispatch behind the previous call.
    """
    kernels, x = [], None
    for fn, params in zip(stage_fns, params_list):
        kernels.append(jpipe.StageKernels.trace(fn, params, x, microbatch))
        x = kernels[-1].y
    pieces = stage_pieces(kernels, params_list, microbatch, [device] * len(kernels))
    programs = []
    for s, piece in enumerate(pieces):
        for kind in ("F", "I", "W", "B"):
            lowerable, piece_args = piece[kind]
            program = measure.compile_program((tag, s, kind), lowerable, piece_args)
            program.fn = _Repeated(program.fn, repeat)
            programs.append(program)
    return programs


def costs_from_times(
    times: dict, tag, num_stages: int, repeat: int = REPEAT
) -> dict[str, list[float]]:
    """Per-stage seconds ``{"F", "I", "W", "B"}`` from `time_together`'s result."""
    costs = {"F": [], "I": [], "W": [], "B": []}

    def per_call(kind, s):
        return measure.median(times[(tag, s, kind)]) / repeat

    for s in range(num_stages):
        for kind in costs:
            costs[kind].append(per_call(kind, s))
    return costs
