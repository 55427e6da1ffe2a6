"""The rows of a benchmark: each a program for one way of running a workload.

Every builder returns a `Row`: a label, something to ``.lower(*args)`` and its
placed arguments, plus what the report needs to know about it (the schedule
and stage count of a jpipe row, the loop length of the peer).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

import jpipe
from bench.baselines import (
    data_parallel,
    lockstep,
    one_device,
    one_device_microbatched,
    spmd_pipeline,
)
from bench.workloads import Workload

# Schedules that place several stages on each rank take `chunks` of them.
MULTI_CHUNK = frozenset({"interleaved_1f1b", "zbv", "dualpipev", "looped_bfs"})

ONE_DEVICE = "one device"
ONE_DEVICE_MICROBATCHED = "one device, microbatched"
DATA_PARALLEL = "data parallel"
PEER_GPIPE = "peer gpipe"


@dataclasses.dataclass
class Row:
    """One way of computing the loss and gradients of a workload.

    Attributes:
      name: the row's label in the table.
      kind: ``"baseline"``, ``"peer"`` or ``"jpipe"``.
      lowerable, args: the program and its placed arguments.
      info: JSON-ready facts for the report (stages, ticks, iterations, ...).
      pipeline: the `jpipe.Pipeline` of a jpipe row, else None.
    """

    name: str
    kind: str
    lowerable: Any
    args: tuple
    info: dict
    pipeline: Any = None


def chunks_for(schedule: str, chunks: int) -> int:
    return chunks if schedule in MULTI_CHUNK else 1


def baseline_rows(workload: Workload, num_microbatches: int, devices) -> list[Row]:
    """One device (whole batch, and microbatch by microbatch) and data parallelism."""
    R = len(devices)
    one = one_device(workload, num_microbatches, R, devices[0])
    mbs = one_device_microbatched(workload, num_microbatches, R, devices[0])
    dp = data_parallel(workload, num_microbatches, R, devices)
    return [
        Row(ONE_DEVICE, "baseline", one.lowerable, one.args, {"devices": 1}),
        Row(ONE_DEVICE_MICROBATCHED, "baseline", mbs.lowerable, mbs.args, {"devices": 1}),
        Row(DATA_PARALLEL, "baseline", dp.lowerable, dp.args, {"devices": R}),
    ]


def peer_row(workload: Workload, num_microbatches: int, devices, repeats: int = 1) -> Row:
    """The vmap-style SPMD pipeline (GPipe by autodiff), plain or circular."""
    peer = spmd_pipeline(workload, num_microbatches, devices, repeats=repeats)
    name = PEER_GPIPE if repeats == 1 else f"peer circular x{repeats}"
    info = {
        "stages": len(devices) * repeats,
        "repeats": repeats,
        "iterations": peer.iterations,
    }
    return Row(name, "peer", peer.lowerable, peer.args, info)


def jpipe_row(
    workload: Workload,
    schedule: str,
    num_microbatches: int,
    devices,
    chunks: int = 2,
    tick_layout: str = "auto",
    all_idle: bool = False,
) -> Row:
    """jpipe running `schedule` on a ``pipe`` mesh of `devices` (all ticks idle with `all_idle`)."""
    R = len(devices)
    V = chunks_for(schedule, chunks)
    sched = jpipe.get_schedule(schedule, R, num_microbatches, V)
    stage_fns, params = workload.stages(sched.num_stages)
    mesh = jpipe.make_mesh(R, 1, devices)
    pipe = jpipe.Pipeline(stage_fns, sched, mesh, tick_layout=tick_layout, all_idle=all_idle)
    packed = pipe.pack(params)
    batch = jax.device_put(workload.batch(num_microbatches), pipe.batch_sharding)
    info = {
        "schedule": schedule,
        "stages": sched.num_stages,
        "chunks": V,
        "ticks": pipe.tick_plan.num_ticks,
        "tick_layout": pipe.tick_plan.layout,
    }
    name = f"jpipe {schedule}" + (f" (V={V})" if V > 1 else "")
    if tick_layout != "auto":
        name += f", {tick_layout}"
    return Row(name, "jpipe", pipe, (packed, batch), info, pipeline=pipe)


def lockstep_rows(workload: Workload, num_microbatches: int, devices) -> list[Row]:
    """The diagnostics of `bench.baselines.lockstep`: a pipeline's work, then lock-step alone."""
    out = []
    for variant in lockstep.VARIANTS:
        program = lockstep.stage_pieces(workload, num_microbatches, devices, variant)
        name = "stage pieces, " + (
            "no barriers" if variant == "free" else f"barrier per piece, {variant}"
        )
        info = {"devices": len(devices), "variant": variant}
        out.append(Row(name, "diagnostic", program.lowerable, program.args, info))
    return out
