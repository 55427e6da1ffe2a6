"""Compile time of the per-rank lowering against the SPMD program, schedule by schedule.

``python -m bench.compile_time [--workload dense] [--ranks 4] [--microbatches 8]
[--schedules interleaved_1f1b,zbv,1f1b] [--rounds 2]`` (about 2 minutes on 2 cores)

Each round compiles every schedule's step under both lowerings from a cold
in-memory cache (`jax.clear_caches`; no persistent cache), the lowerings
alternated, and reads the process's CPU seconds (`time.process_time`: the
compiler's own threads included, so another job on the machine changes the
figure less than a wall clock would). The per-rank row also gives the
programs it compiled: one per stage and piece kind the schedule issues.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jpipe

if __name__ == "__main__":
    jpipe.use_cpu_devices(8)

import jax  # noqa: E402

from bench.workloads import get_workload  # noqa: E402


def compile_seconds(workload, name: str, R: int, M: int, lowering: str) -> tuple[float, int]:
    """CPU seconds to compile one step of `name`, and the programs compiled (1 for SPMD)."""
    schedule = jpipe.get_schedule(name, R, M)
    jax.clear_caches()
    fns, params = workload.stages(schedule.num_stages)
    pipe = jpipe.Pipeline(fns, schedule, jpipe.make_mesh(R, 1), lowering=lowering)
    packed = pipe.pack(params)
    batch = jax.device_put(workload.batch(M, 0), pipe.batch_sharding)
    start = time.process_time()
    compiled = pipe.compile(packed, batch)
    seconds = time.process_time() - start
    if isinstance(compiled, jpipe.RankPrograms):
        return seconds, sum(len(c) for c in compiled.compiled.values())
    return seconds, 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.compile_time")
    parser.add_argument("--workload", default="dense")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedules", default="interleaved_1f1b,zbv,1f1b")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    workload = get_workload(args.workload)
    print(f"{workload.description}; R={args.ranks}, M={args.microbatches}; CPU seconds, median")
    print("| schedule | SPMD | per-rank | per-rank / SPMD | per-rank programs |")
    print("|---|---|---|---|---|")
    for name in args.schedules.split(","):
        times = {"spmd": [], "mpmd": []}
        programs = None
        for _ in range(args.rounds):
            for lowering in times:
                t, n = compile_seconds(workload, name, args.ranks, args.microbatches, lowering)
                times[lowering].append(t)
                if lowering == "mpmd":
                    programs = n
        spmd, mpmd = (statistics.median(times[k]) for k in ("spmd", "mpmd"))
        print(f"| {name} | {spmd:.2f} | {mpmd:.2f} | {mpmd / spmd:.2f} | {programs} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
