"""The memory suite: what a device would hold for GPT-2-small shapes, compiled, not run.

``python -m bench --suite memory [--quick] [--json]``

For GPT-2 small's shapes (12 blocks, D = 768, 12 heads, L = 1024, GPT-2's real
50,257-token vocabulary, bfloat16 compute, microbatches of 4 sequences) on 4
and 8 fake CPU devices, each schedule's training step is compiled from shape
structs only (`jpipe.Pipeline.packed_shapes`: no array is made) and its
per-device `memory_analysis()` read. Beside it, what the schedule needs:

- ``need_bytes``: the largest rank's need from the schedule alone, as the
  compiler's own pieces size it: at the simulator's peak, the residuals and
  I-to-W carries that rank holds live at their real sizes (each stage's
  `jpipe.StageKernels` residual and carry bytes, the live values counted by
  `jpipe.simulate`'s timeline), plus one activation in and one out per piece
  kind, plus its parameters' gradient accumulator.
- ``param_bytes``: parameter bytes per device as packed (each bucket's row
  for every rank), and ``own_param_bytes``: the largest rank's own.

The interleaved and V schedules run only on 4 devices: 8 ranks x 2 chunks
is 16 stages, more than 12 blocks can fill (a middle stage must hold one).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

import jpipe
from jpipe import models
from jpipe.models import gpt

GPT2_SMALL = gpt.GPTConfig(
    vocab_size=50257,
    seq_len=1024,
    num_layers=12,
    num_heads=12,
    d_model=768,
    d_ff=3072,
    dtype="bfloat16",
)
MICROBATCH = 4  # sequences
SCHEDULES = (("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2), ("zbv", 2))


def _bytes(avals) -> int:
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in avals)


def live_need(schedule: jpipe.Schedule, kernels, grad_bytes: list[int]) -> list[int]:
    """Each rank's peak bytes of live residuals and carries, plus its pieces' working set.

    A ``(stage, microbatch)``'s residuals live from its F to the end of its W
    (or B); its carry from its I to its W. The peak is taken over the unit-cost
    timeline of `jpipe.simulate`.
    """
    sim = jpipe.simulate(schedule)
    res = [_bytes(k.res_avals) for k in kernels]
    carry = [_bytes(k.carry_avals) for k in kernels]
    act = [_bytes(jax.tree.leaves(k.y)) for k in kernels]
    events = []  # (time, +/- bytes, rank)
    owner = schedule.stage_to_rank
    started = {}
    for e in sim.timeline:
        a = e.action
        key = (a.stage, a.microbatch)
        r = owner[a.stage]
        if a.kind == "F":
            events.append((e.start, res[a.stage], r))
            started[key] = e.start
        elif a.kind == "I":
            events.append((e.end, carry[a.stage], r))
        elif a.kind == "W":
            events.append((e.end, -res[a.stage] - carry[a.stage], r))
        elif a.kind == "B":
            events.append((e.end, -res[a.stage], r))
    peak = [0] * schedule.num_ranks
    live = [0] * schedule.num_ranks
    # Frees before allocations at the same instant (a B's end and the next F's start).
    for _, delta, r in sorted(events, key=lambda t: (t[0], t[1])):
        live[r] += delta
        peak[r] = max(peak[r], live[r])
    need = []
    for r in range(schedule.num_ranks):
        stages = [s for s in range(len(kernels)) if owner[s] == r]
        working = max(2 * act[s] for s in stages) if stages else 0
        need.append(peak[r] + working + grad_bytes[r])
    return need


def row(num_devices: int, name: str, chunks: int, M: int) -> dict:
    schedule = jpipe.get_schedule(name, num_devices, M, chunks if chunks > 1 else None)
    S = schedule.num_stages
    model = gpt.make_stages(GPT2_SMALL, models.split_layers(GPT2_SMALL.num_layers, S))
    mesh = jpipe.make_mesh(num_devices, 1, jax.devices()[:num_devices])
    pipe = jpipe.Pipeline(model.stages, schedule, mesh)
    params = jax.eval_shape(model.init, jax.random.key(0))
    packed = pipe.packed_shapes(params)
    L = GPT2_SMALL.seq_len
    batch = {
        k: jax.ShapeDtypeStruct((M * MICROBATCH, L), jnp.int32, sharding=pipe.batch_sharding)
        for k in ("tokens", "targets")
    }
    compiled = jax.jit(pipe.step_fn(batch)).lower(packed, batch).compile()
    memory = compiled.memory_analysis()
    own = [0] * num_devices
    for s, p in enumerate(params):
        own[schedule.stage_to_rank[s]] += _bytes(jax.tree.leaves(p))
    param_bytes = sum(
        math.prod(sh) * np.dtype(dt).itemsize for sh, dt in pipe.layout.buckets.values()
    )
    need = live_need(schedule, pipe.stage_kernels(batch), own)
    return {
        "schedule": name,
        "chunks": chunks,
        "microbatches": M,
        "devices": num_devices,
        "temp_bytes": int(memory.temp_size_in_bytes),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "need_bytes": max(need),
        "need_per_rank": need,
        "param_bytes": param_bytes,
        "own_param_bytes": max(own),
    }


def run(args, log=print) -> list[dict]:
    out = []
    counts = (4,) if args.quick else (4, 8)
    for D in counts:
        for name, chunks in SCHEDULES:
            if D * chunks > GPT2_SMALL.num_layers + 2:
                continue
            for M in (16,) if args.quick else (16, 64):
                rec = row(D, name, chunks, M)
                gib = 2**30
                log(
                    f"  {D} devices, {name}, M={M}: temp {rec['temp_bytes'] / gib:.2f} GiB, "
                    f"need {rec['need_bytes'] / gib:.2f} GiB, params {rec['param_bytes'] / gib:.3f}"
                    f" GiB (own {rec['own_param_bytes'] / gib:.3f})"
                )
                out.append(rec)
    return out
