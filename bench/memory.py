"""The memory suite: what a device would hold for GPT-2-small shapes, compiled, not run.

``python -m bench --suite memory [--quick] [--json]``

For GPT-2 small's shapes (12 blocks, D = 768, 12 heads, L = 1024, GPT-2's real
50,257-token vocabulary, bfloat16 compute, microbatches of 4 sequences) on 4
and 8 fake CPU devices, each schedule's training step is compiled from shape
structs only (`jpipe.Pipeline.packed_shapes`: no array is made) and its
per-device `memory_analysis()` read. Beside it, what the schedule needs:

- ``need_bytes``: the largest rank's need from the schedule alone, as the
  compiler's own pieces size it: the simulator's peak bytes (`jpipe.simulate`
  with `jpipe.Sizes`: each stage's residual and I-to-W carry bytes from its
  `jpipe.StageKernels`, live as the rank's list runs, plus the gradient
  accumulator of its stages), plus the working memory of the rank's largest
  piece: each of its stages' F, I and W compiled alone on one device, the
  piece's temp and output bytes, and the stage's activation in and out
  (`piece_working_bytes`).
  (``need_2act_bytes`` keeps the earlier, smaller estimate of the working
  memory: one activation in and one out.)
- ``param_bytes``: parameter bytes per device as packed (each bucket's row
  for every rank), and ``own_param_bytes``: the largest rank's own.

The interleaved and V schedules run only on 4 devices: 8 ranks x 2 chunks
is 16 stages, more than 12 blocks can fill (a middle stage must hold one).
The last rows (not with ``--quick``) are the schedules that trade time for
memory (`MEMORY_SCHEDULES`) on 8 devices with 16 blocks of GPT-2 small's
widths, M = 16, with the head's logits kept and in 8 slices
(`GPTConfig.logit_chunks`): docs/compiler-measurements.md, "Issue 23's
memory targets in the SPMD program".
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

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
# The schedules that trade time for memory, against 1F1B (issue 23's targets): on 8
# devices with 16 blocks, so that 8 ranks of V stages (16 stages) each hold a block.
MEMORY_SCHEDULES = (
    ("1f1b", 1),
    ("1f1b_recompute:k=2", 1),
    ("1f1b_bpipe", 1),
    ("vhalf", 2),
    ("vmin", 2),
    ("zbv", 2),
    ("zbv:max_deferred_w=0", 2),
)


def _bytes(avals) -> int:
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in avals)


def piece_working_bytes(kernels, classes=None, mesh=None) -> list[int]:
    """Per stage, the working memory of its largest piece, compiled alone on one device.

    A piece's working memory is what it allocates beyond the values the
    schedule already counts (parameters, residuals, carries): its compiled
    temp bytes, its outputs (new residuals or carries, the activation or
    gradient it sends, a weight gradient), and the stage's activation in and
    out (what it reads and what arrives for it; an upper bound).
    Stages of one class (`jpipe.Program.classes`: the same programs on the
    same shapes, sharing one branch of the step) are compiled once.

    With `mesh` (for stages whose functions name mesh axes, such as
    ``tensor``'s collectives), each piece is compiled inside a `jax.shard_map`
    over it with every argument replicated: each device runs the one-device
    shapes the pieces were traced for, collectives included.
    """

    def shapes(avals):
        return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]

    classes = classes or tuple(range(len(kernels)))
    done: dict = {}
    for k, c in zip(kernels, classes):
        if c in done:
            continue
        res, carry = shapes(k.res_avals), shapes(k.carry_avals)
        y = shapes(jax.tree.leaves(k.y))
        act = _bytes(y) + (_bytes(jax.tree.leaves(k.x)) if k.has_x else 0)
        pieces = (
            (k.forward, (k.params, k.x, k.inputs)),
            (k.input_grad, (k.params, k.inputs, res, y)),
            (k.weight_grad, (k.params, k.inputs, res, carry)),
        )
        most = 0
        for fn, args in pieces:
            if mesh is not None:
                fn = jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
            memory = jax.jit(fn).lower(*args).compile().memory_analysis()
            most = max(most, memory.temp_size_in_bytes + memory.output_size_in_bytes)
        done[c] = most + act
    return [done[c] for c in classes]


def live_need(
    schedule: jpipe.Schedule, kernels, grad_bytes: list[int], working: list[int] | None = None
) -> list[int]:
    """Each rank's need: the simulator's peak bytes plus its largest piece's working set.

    `jpipe.simulate` with `jpipe.Sizes` from the compiled pieces: a stage's
    residuals (`StageKernels.res_avals`) live from its F to its W, its carry
    (`carry_avals`) from its I to its W, and its gradient accumulator
    (`grad_bytes`, as big as its parameters) all step. The working set of a
    piece is `working` per stage (`piece_working_bytes`), or, without it,
    one activation in and one out.
    """
    live, work = live_and_working(schedule, kernels, grad_bytes, working)
    return [a + b for a, b in zip(live, work)]


def live_and_working(
    schedule: jpipe.Schedule, kernels, grad_bytes: list[int], working: list[int] | None = None
) -> tuple[list[int], list[int]]:
    """The two terms of `live_need`, per rank: the simulator's peak bytes, and the
    working set of the rank's largest piece.

    Their maxima over the ranks, summed, are the *SPMD floor*: every device of
    one SPMD program allocates the largest rank's buffers and room for the
    largest piece, which may be on different ranks.
    """
    sizes = jpipe.Sizes(
        activation=[_bytes(k.res_avals) for k in kernels],
        carry=[_bytes(k.carry_avals) for k in kernels],
        params=grad_bytes,
        # what an FC keeps: the stage's input activation (stage 0's is in the batch)
        input=[0] + [_bytes(jax.tree.leaves(k.y)) for k in kernels[:-1]],
    )
    peaks = jpipe.simulate(schedule, sizes=sizes).peak_bytes
    if working is None:
        working = [2 * _bytes(jax.tree.leaves(k.y)) for k in kernels]
    R = schedule.num_ranks
    work = [max((working[s] for s in schedule.stages_of(r)), default=0) for r in range(R)]
    return [int(p) for p in peaks], work


def row(
    num_devices: int,
    name: str,
    chunks: int,
    M: int,
    config: gpt.GPTConfig = GPT2_SMALL,
    control: str = "auto",
) -> dict:
    """One compiled point of the table (see the module docstring)."""
    schedule = jpipe.get_schedule(name, num_devices, M, chunks if chunks > 1 else None)
    S = schedule.num_stages
    model = gpt.make_stages(config, models.split_layers(config.num_layers, S))
    mesh = jpipe.make_mesh(num_devices, 1, jax.devices()[:num_devices])
    pipe = jpipe.Pipeline(model.stages, schedule, mesh, control=control)
    params = jax.eval_shape(model.init, jax.random.key(0))
    packed = pipe.packed_shapes(params)
    L = config.seq_len
    batch = {
        k: jax.ShapeDtypeStruct((M * MICROBATCH, L), jnp.int32, sharding=pipe.batch_sharding)
        for k in ("tokens", "targets")
    }
    compiled = jax.jit(pipe.step_fn(batch)).lower(packed, batch).compile()
    memory = compiled.memory_analysis()
    stage_bytes = [_bytes(jax.tree.leaves(p)) for p in params]
    own = [0] * num_devices
    for s, b in enumerate(stage_bytes):
        own[schedule.stage_to_rank[s]] += b
    param_bytes = sum(
        math.prod(sh) * np.dtype(dt).itemsize for sh, dt in pipe.layout.buckets.values()
    )
    kernels = pipe.stage_kernels(batch)
    working = piece_working_bytes(kernels, pipe.program(batch).classes)
    live, work = live_and_working(schedule, kernels, stage_bytes, working)
    need = [a + b for a, b in zip(live, work)]
    need_2act = live_need(schedule, kernels, stage_bytes)
    return {
        "schedule": name,
        "chunks": chunks,
        "microbatches": M,
        "devices": num_devices,
        "control": pipe.program(batch).control,
        "conditionals": compiled.as_text().count(" conditional("),
        "temp_bytes": int(memory.temp_size_in_bytes),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "need_bytes": max(need),
        "need_per_rank": need,
        # the SPMD floor: the largest rank's live values plus the largest piece
        "floor_bytes": max(live) + max(work),
        "live_per_rank": live,
        "working_per_rank": work,
        "need_2act_bytes": max(need_2act),
        "remat_logits": config.remat_logits,
        "logit_chunks": config.logit_chunks,
        "blocks": config.num_layers,
        "param_bytes": param_bytes,
        "own_param_bytes": max(own),
        # each value buffer of the program (residuals, I-to-W carries, host copies)
        "arena_bytes": {
            k: rows * jpipe.Program.ROW * 4 for k, rows in pipe.program(batch).arena_rows.items()
        },
    }


def run(args, log=print) -> list[dict]:
    """Every row: 4 and 8 devices (quick: 4), M = 16 and 64 (quick: 16), then the
    same at M = 16 with the head's logits recomputed (`GPTConfig.remat_logits`);
    then (not quick) `MEMORY_SCHEDULES` on 8 devices, 16 blocks, M = 16, with the
    head's logits kept and in 8 slices (`GPTConfig.logit_chunks`)."""
    out = []
    counts = (4,) if args.quick else (4, 8)
    remat = dataclasses.replace(GPT2_SMALL, remat_logits=True)
    for config, Ms in ((GPT2_SMALL, (16,) if args.quick else (16, 64)), (remat, (16,))):
        for D in counts:
            for name, chunks in SCHEDULES:
                if D * chunks > config.num_layers + 2:
                    continue
                for M in Ms:
                    rec = row(D, name, chunks, M, config)
                    gib = 2**30
                    log(
                        f"  {D} devices, {name}, M={M}, remat_logits={config.remat_logits}: "
                        f"temp {rec['temp_bytes'] / gib:.2f} GiB, need "
                        f"{rec['need_bytes'] / gib:.2f} GiB, params "
                        f"{rec['param_bytes'] / gib:.3f} GiB "
                        f"(own {rec['own_param_bytes'] / gib:.3f})"
                    )
                    out.append(rec)
    if not args.quick:
        wide = dataclasses.replace(GPT2_SMALL, num_layers=16)
        for config in (wide, dataclasses.replace(wide, logit_chunks=8)):
            for name, chunks in MEMORY_SCHEDULES:
                rec = row(8, name, chunks, 16, config)
                log(
                    f"  8 devices, 16 blocks, {name}, M=16, logit_chunks={config.logit_chunks}: "
                    f"temp {rec['temp_bytes'] / 2**30:.2f} GiB"
                )
                out.append(rec)
    return out
