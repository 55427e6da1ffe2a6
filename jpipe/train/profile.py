"""Profile: each stage's F, I and W timed on the real devices, fed to the simulator.

`measure_stages` times the very pieces the compiled step runs
(`jpipe.Pipeline.stage_kernels`), one microbatch on its rank's device; the
benchmarks time the same pieces with it. `print_profile` compares the
simulator's predictions from those times with the measured train step, and
`stage_profile` turns the times into the planner's profile format (one profile
"layer" per stage), which the trainer writes to ``WORKDIR/profile.json`` for
``python -m jpipe.plan --profiles WORKDIR/profile.json``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from typing import NamedTuple

import jax
import numpy as np

import jpipe
from jpipe.planner import MemoryTerms, Profile, profile_from_stage_times, spmd_values
from jpipe.stage.pieces import stage_pieces
from jpipe.train.metrics import mib, say


class StageTimes(NamedTuple):
    """Seconds per microbatch for each stage's pieces (medians of a few runs)."""

    F: tuple[float, ...]
    I: tuple[float, ...]
    W: tuple[float, ...]
    B: tuple[float, ...]


def _median_seconds(fn, *args, reps: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_stages(
    pipeline: jpipe.Pipeline, params: dict, batch: dict, microbatch: dict, reps: int = 5
) -> StageTimes:
    """Times each stage's F, I and W pieces on one microbatch, on its rank's device.

    The pieces are the ones the compiled step runs (`Pipeline.stage_kernels`):
    F keeps the residuals, I computes the input gradient and the carry, W the
    weight gradient from them; B is I + W, as the program runs it.

    Args:
      pipeline: the pipeline, with parameters packed.
      params: the packed parameters.
      batch: a global batch (fixes the shapes the pieces were traced for).
      microbatch: one microbatch as one device sees it (host arrays).
      reps: timed runs per piece, after one warm-up.
    """
    stage_to_rank = pipeline.stage_to_rank
    devices = [pipeline.mesh.devices[stage_to_rank[s]].flat[0] for s in range(len(stage_to_rank))]
    pieces = stage_pieces(
        pipeline.stage_kernels(batch),
        pipeline.unpack(params),
        microbatch,
        devices,
        pipeline.num_microbatches,
    )
    F, I, W = (
        [_median_seconds(piece[kind][0], *piece[kind][1], reps=reps) for piece in pieces]
        for kind in ("F", "I", "W")
    )
    B = tuple(i + w for i, w in zip(I, W))
    return StageTimes(tuple(F), tuple(I), tuple(W), B)


def _nbytes(avals) -> float:
    return float(sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in avals))


def measured_memory_terms(
    pipeline: jpipe.Pipeline, params: dict, opt_state, kernels, memory, device
) -> MemoryTerms:
    """The runtime's memory terms as this run measures them (`jpipe.planner.MemoryTerms`).

    Bytes per parameter from the arrays: the weights' (the packed rows' bytes
    over their elements), gradients the same (the step accumulates them in the
    weights' dtype), the optimizer state's bytes over the weights' elements, no
    other buffers (the step donates its state). The working factor from the
    compiled step's temp (`memory_analysis()`): what is left once the
    residual and carry buffers the planner counts (`jpipe.planner.spmd_values`)
    and the gradient accumulators are taken away, in units of the largest
    stage's residuals per microbatch (at least 0). The overhead is 0: XLA's
    pool holds only the program's buffers, and what the platform keeps outside
    it is the usable fraction (``XLA_PYTHON_CLIENT_MEM_FRACTION``, 0.75 unless
    set, on GPUs whose allocator is XLA's own; all of a CPU's or TPU's).

    Not modelled: the optimizer state's bytes are per parameter over the whole
    model, so a run with ``optimizer.shard_over_data`` (ZeRO-1, each device
    1/data of it) is counted as if unsharded, an overestimate.
    """
    leaves = jax.tree.leaves(params)
    elements = sum(leaf.size for leaf in leaves)
    weight = sum(leaf.nbytes for leaf in leaves) / max(elements, 1)
    optimizer = sum(leaf.nbytes for leaf in jax.tree.leaves(opt_state)) / max(elements, 1)
    acts = [_nbytes(k.res_avals) for k in kernels]
    owner = pipeline.schedule.stage_to_rank
    stage_elements = [sum(x.size for x in jax.tree.leaves(t)) for t in pipeline.unpack(params)]
    per_rank = [
        sum(n for s, n in enumerate(stage_elements) if owner[s] == r)
        for r in range(pipeline.schedule.num_ranks)
    ]
    values = spmd_values(pipeline.schedule, acts)
    left = memory.temp_size_in_bytes - values - weight * max(per_rank)
    working = max(0.0, left) / max(max(acts), 1.0)
    platform = device.platform
    env = lambda name: (  # noqa: E731  (JAX reads both spellings)
        os.environ.get(f"XLA_CLIENT_{name}") or os.environ.get(f"XLA_PYTHON_CLIENT_{name}")
    )
    capped = platform == "gpu" and (env("ALLOCATOR") or "").lower() != "platform"
    fraction = float(env("MEM_FRACTION") or 0.75) if capped else 1.0
    return MemoryTerms(
        weight_bytes=weight,
        gradient_bytes=weight,
        optimizer_bytes=optimizer,
        buffer_bytes=0.0,
        overhead_bytes=0.0,
        working_factor=working,
        usable_fraction=fraction,
        source="jpipe's runtime, measured by train.py --config.profile=True on "
        + device.device_kind,
    )


def stage_profile(
    pipeline: jpipe.Pipeline,
    params: dict,
    times: StageTimes,
    microbatch_size: int,
    layers_per_stage,
    model: str = "gpt",
    *,
    opt_state=None,
    pieces_batch=None,
    compiled=None,
) -> Profile:
    """The measured stage times as a planner profile (`jpipe.planner.Profile`).

    Each stage is one profile layer holding its blocks; its parameters are the
    stage's own, its device type and memory those of rank 0's device. With
    `opt_state`, `pieces_batch` (what the pieces were traced for) and the
    `compiled` step, it also carries the stages' residual and output bytes
    per microbatch (from `jpipe.Pipeline.stage_kernels`) and the runtime's
    measured memory terms (`measured_memory_terms`).
    """
    device = pipeline.mesh.devices.flat[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    memory = (stats or {}).get("bytes_limit")
    counts = [float(sum(leaf.size for leaf in jax.tree.leaves(p))) for p in pipeline.unpack(params)]
    extra = {}
    analysis = compiled.memory_analysis() if compiled is not None else None
    if opt_state is not None and pieces_batch is not None and analysis is not None:
        kernels = pipeline.stage_kernels(pieces_batch)
        extra = dict(
            activation_bytes=[_nbytes(k.res_avals) for k in kernels],
            output_bytes=[_nbytes(jax.tree.leaves(k.y)) for k in kernels],
            memory_terms=measured_memory_terms(
                pipeline, params, opt_state, kernels, analysis, device
            ),
        )
        if memory is not None:  # the device's memory, not the share JAX may take
            memory = memory / extra["memory_terms"].usable_fraction
    return profile_from_stage_times(
        times,
        device.device_kind,
        microbatch_size=microbatch_size,
        params=counts,
        memory_bytes=memory,
        blocks_per_stage=layers_per_stage,
        model=model,
        **extra,
    )


def print_profile(
    pipeline, compiled, state, batch, microbatch, reps: int = 5, pieces_batch=None
) -> StageTimes | None:
    """Prints measured stage times, the predicted step times and the measured one.

    `batch` is what the compiled step takes; `pieces_batch` (default `batch`)
    what its pieces were traced for, when the step adds to the batch (dropout
    keys); `microbatch` is one microbatch of the latter.

    Returns the measured times, or None where it could not measure them.
    """
    if jax.process_count() > 1:
        say("profile: skipped, it runs every stage from one process (single-process runs only)")
        return None
    pieces_batch = batch if pieces_batch is None else pieces_batch
    times = measure_stages(pipeline, state.params, pieces_batch, microbatch, reps=reps)
    ms = lambda t: f"{t * 1e3:8.2f}"  # noqa: E731
    say(f"profile: time of one microbatch on one device, ms (median of {reps} runs)")
    say("  stage         F        I        W        B")
    for s in range(len(times.F)):
        say(f"  {s:>5} {ms(times.F[s])} {ms(times.I[s])} {ms(times.W[s])} {ms(times.B[s])}")
    costs = jpipe.Costs(F=times.F, I=times.I, W=times.W, B=times.B)
    sim = jpipe.simulate(pipeline.schedule, costs)
    lockstep = pipeline.tick_plan.predicted_time(costs)

    # The measured step runs on a copy, so the real state neither advances nor is donated.
    step_times = []
    for _ in range(reps + 1):
        scratch = jax.tree.map(lambda a: a.copy(), state)
        start = time.perf_counter()
        jax.block_until_ready(compiled(scratch, batch))
        step_times.append(time.perf_counter() - start)
    measured = statistics.median(step_times[1:])
    say(
        f"  predicted step time, event simulation (perfect overlap): {sim.makespan * 1e3:9.2f} ms"
        f"  (bubble {sim.bubble_fraction:.1%})"
    )
    say(
        f"  predicted step time, lock-step program (TickPlan.predicted_time):"
        f" {lockstep * 1e3:9.2f} ms"
    )
    say(
        f"  measured train step (median of {reps}, with the optimizer update):"
        f" {measured * 1e3:9.2f} ms"
    )
    if all(d.platform == "cpu" for d in list(pipeline.mesh.devices.flat)):
        say(
            "  (fake CPU devices share the host's cores, so the measured step cannot overlap ranks)"
        )
    return times


def compiled_bytes(memory) -> float:
    """What one device holds for the compiled step: its arguments, temporaries and the
    outputs that do not reuse a donated argument's buffer."""
    return float(
        memory.argument_size_in_bytes
        + memory.temp_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
    )


def plan_memory_line(plan_path: str, memory) -> str:
    """One line: the compiled step's per-device bytes beside the plan file's footprint."""
    with open(plan_path) as f:
        devices = json.load(f).get("devices") or []
    have = compiled_bytes(memory)
    parts = (
        f"arguments {mib(memory.argument_size_in_bytes)}, temporaries "
        f"{mib(memory.temp_size_in_bytes)}, outputs {mib(memory.output_size_in_bytes)} "
        f"({mib(memory.alias_size_in_bytes)} reusing donated arguments)"
    )
    if not devices:
        return (
            f"memory: the compiled step holds {mib(have)} per device ({parts}); the plan file "
            "has no footprint (written by an older jpipe.plan)"
        )
    planned = max(d["footprint_bytes"] for d in devices)
    return (
        f"memory: the compiled step holds {mib(have)} per device ({parts}); the plan's "
        f"footprint is {mib(planned)} (planner / compiled = {planned / max(have, 1):.2f})"
    )
