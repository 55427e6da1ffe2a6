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

import statistics
import time
from typing import NamedTuple

import jax

import jpipe
from jpipe._stage import stage_pieces
from jpipe.planner import Profile, profile_from_stage_times
from jpipe.train.metrics import say


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
    stage_to_rank = pipeline.plan.stage_to_rank
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


def stage_profile(
    pipeline: jpipe.Pipeline,
    params: dict,
    times: StageTimes,
    microbatch_size: int,
    layers_per_stage,
    model: str = "gpt",
) -> Profile:
    """The measured stage times as a planner profile (`jpipe.planner.Profile`).

    Each stage is one profile layer holding its blocks; its parameter bytes
    are the stage's own, its device type and memory those of rank 0's device.
    """
    device = pipeline.mesh.devices.flat[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    memory = (stats or {}).get("bytes_limit")
    params_bytes = [
        float(sum(leaf.nbytes for leaf in jax.tree.leaves(p))) for p in pipeline.unpack(params)
    ]
    return profile_from_stage_times(
        times,
        device.device_kind,
        microbatch_size=microbatch_size,
        params_bytes=params_bytes,
        memory_bytes=memory,
        blocks_per_stage=layers_per_stage,
        model=model,
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
    lockstep = pipeline.plan.predicted_time(costs)

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
    say(f"  predicted step time, lock-step program (Plan.predicted_time): {lockstep * 1e3:9.2f} ms")
    say(
        f"  measured train step (median of {reps}, with the optimizer update):"
        f" {measured * 1e3:9.2f} ms"
    )
    if all(d.platform == "cpu" for d in list(pipeline.mesh.devices.flat)):
        say(
            "  (fake CPU devices share the host's cores, so the measured step cannot overlap ranks)"
        )
    return times
