"""Compile time of the per-rank lowering against the SPMD program, schedule by schedule.

``python -m bench.compile_time [--workload dense] [--ranks 4] [--microbatches 8]
[--schedules interleaved_1f1b,zbv,1f1b] [--rounds 2]`` (about 2 minutes on 2 cores)

Each round compiles every schedule's step under both lowerings from a cold
in-memory cache (`jax.clear_caches`; no persistent cache), the lowerings
alternated, and reads the process's CPU seconds (`time.process_time`: the
compiler's own threads included, so another job on the machine changes the
figure less than a wall clock would). The per-rank lowering's row also gives
how many executables it made: pieces whose lowered programs are the same
text on one rank (a rank's middle stages, in interleaved 1F1B or ZB-V) share
one (`RankPrograms.compiles`); ``--no-share`` compiles every piece, as
before, to show what that sharing saves.
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
from jpipe.lower.mpmd.programs import RankPrograms  # noqa: E402

_SHARED = RankPrograms._compile_pieces


def _every_piece(self, keys, batch):
    """Every piece compiled on its own (no sharing), for comparison."""
    self.compiles = len(keys)
    return {
        (s, k): self.pieces[s][k].lower(*self._piece_args(s, k, batch)).compile() for s, k in keys
    }


def compile_seconds(workload, name: str, R: int, M: int, lowering: str) -> tuple[float, int]:
    """CPU seconds to compile one step of `name`, and the executables made (1 for SPMD)."""
    schedule = jpipe.get_schedule(name, R, M)
    S = schedule.num_stages
    fns, params = workload.stages(S)
    jax.clear_caches()
    pipe = jpipe.Pipeline(fns, schedule, jpipe.make_mesh(R, 1), lowering=lowering)
    packed = pipe.pack(params)
    batch = jax.device_put(workload.batch(M, 0), pipe.batch_sharding)
    start = time.process_time()
    compiled = pipe.compile(packed, batch)
    seconds = time.process_time() - start
    return seconds, getattr(compiled, "compiles", None) or 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.compile_time")
    parser.add_argument("--workload", default="dense")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedules", default="interleaved_1f1b,zbv,1f1b")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-share", action="store_true", help="also time every piece compiled")
    args = parser.parse_args(argv)
    workload = get_workload(args.workload)
    variants = ["spmd", "mpmd"] + (["mpmd, every piece"] if args.no_share else [])
    print(f"{workload.description}; R={args.ranks}, M={args.microbatches}; CPU seconds")
    print("| schedule | " + " | ".join(variants) + " | per-rank / SPMD | executables |")
    print("|---" * (len(variants) + 3) + "|")
    for name in args.schedules.split(","):
        times = {v: [] for v in variants}
        count = None
        for _ in range(args.rounds):
            for v in variants:
                RankPrograms._compile_pieces = _every_piece if v.endswith("piece") else _SHARED
                t, n = compile_seconds(workload, name, args.ranks, args.microbatches, v[:4])
                times[v].append(t)
                if v == "mpmd":
                    count = n
        RankPrograms._compile_pieces = _SHARED
        med = {v: statistics.median(ts) for v, ts in times.items()}
        cells = " | ".join(f"{med[v]:.2f}" for v in variants)
        print(f"| {name} | {cells} | {med['mpmd'] / med['spmd']:.2f} | {count} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
