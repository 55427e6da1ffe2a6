"""The profiler: what F, I and W of each stage cost on one device.

For each stage of a cut model, on one microbatch and one device:

- ``F``: the stage's forward under `jax.vjp`, returning its output and the
  residuals its backward needs, less those that are inputs already (the
  parameters, the activation, the microbatch): what a pipeline keeps;
- ``B``: the whole backward from those residuals (input and weight gradient);
- ``I``: the input gradient alone (XLA drops the weight-gradient work);
- ``W``: ``B - I``, the weight-gradient work a split backward leaves for later.

The first stage has no input gradient (``I = 0``, ``W = B``).

`stage_programs` compiles the pieces once; the caller times them together
with the rows they predict (`bench.measure.time_together`), so that the costs
and the steps they are compared with come from the same minutes of a shared
machine, and `costs_from_times` turns the medians into per-stage costs for
`jpipe.Costs`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bench import measure

# Calls of a piece per timed run (see `stage_programs`).
REPEAT = 4


def _pieces(fn, has_x: bool):
    """A stage's forward and backward, with the residuals passed between them.

    ``forward(params, x, inputs) -> (y, residuals)``;
    ``backward(params, x, inputs, residuals, g) -> (dparams, dx)``.

    The forward returns only the residuals that are not already inputs (the
    parameters, the activation, the microbatch), as a pipeline keeps them;
    the backward rebuilds `jax.vjp`'s function from both and applies it,
    returning ``(dparams, dx)`` (just ``(dparams,)`` for a first stage).
    """
    layout = {}

    def forward(params, x, inputs):
        if has_x:
            y, vjp_fn = jax.vjp(lambda p, x_: fn(p, x_, inputs), params, x)
        else:
            y, vjp_fn = jax.vjp(lambda p: fn(p, None, inputs), params)
        leaves, layout["tree"] = jax.tree.flatten(vjp_fn)
        known = jax.tree.leaves((params, x, inputs))
        where, residuals = [], []
        for leaf in leaves:
            same = next((i for i, k in enumerate(known) if leaf is k), None)
            if same is not None:
                where.append(("known", same))
            elif hasattr(leaf, "shape"):
                where.append(("res", len(residuals)))
                residuals.append(leaf)
            else:
                where.append(("const", leaf))
        layout["where"] = where
        return y, residuals

    def backward(params, x, inputs, residuals, g):
        known = jax.tree.leaves((params, x, inputs))
        pick = {"known": known, "res": residuals}
        leaves = [v if kind == "const" else pick[kind][v] for kind, v in layout["where"]]
        return jax.tree.unflatten(layout["tree"], leaves)(g)

    return forward, backward


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
    inputs = jax.device_put(microbatch, device)
    params_list = jax.device_put(params_list, device)
    programs = []
    x = None
    for s, (fn, params) in enumerate(zip(stage_fns, params_list)):
        has_x = x is not None
        forward, backward = _pieces(fn, has_x)
        f = jax.jit(forward)
        y, residuals = f(params, x, inputs)
        g = jax.tree.map(jnp.ones_like, y)
        args = (params, x, inputs, residuals, g)
        pieces = [("F", f, (params, x, inputs)), ("B", jax.jit(backward), args)]
        if has_x:
            pieces.append(("I", jax.jit(lambda *a, b=backward: b(*a)[1]), args))
        for kind, lowerable, piece_args in pieces:
            program = measure.compile_program((tag, s, kind), lowerable, piece_args)
            program.fn = _Repeated(program.fn, repeat)
            programs.append(program)
        x = y
    return programs


def costs_from_times(
    times: dict, tag, num_stages: int, repeat: int = REPEAT
) -> dict[str, list[float]]:
    """Per-stage seconds ``{"F", "I", "W", "B"}`` from `time_together`'s result."""
    costs = {"F": [], "I": [], "W": [], "B": []}

    def per_call(kind, s):
        return measure.median(times[(tag, s, kind)]) / repeat

    for s in range(num_stages):
        f = per_call("F", s)
        b = per_call("B", s)
        i = min(per_call("I", s), b) if (tag, s, "I") in times else 0.0
        costs["F"].append(f)
        costs["B"].append(b)
        costs["I"].append(i)
        costs["W"].append(b - i)
    return costs


def stage_costs(stage_fns, params_list, microbatch, device, reps: int = 10) -> dict:
    """Profiles on its own: compiles, times `reps` rounds, returns the costs."""
    programs = stage_programs(stage_fns, params_list, microbatch, device, "stage")
    times = measure.time_together(programs, reps, warmup=2)
    return costs_from_times(times, "stage", len(stage_fns))
