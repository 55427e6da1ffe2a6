"""The per-rank lowering's own cost: host operations a step and the time to issue them.

``python -m bench.mpmd_host [--ranks 4 8] [--microbatches 8 32 64] [--steps 5]``
(about 3 minutes on 2 cores)

The per-rank lowering (`jpipe.RankPrograms`) runs a step as many small
programs issued one by one from one Python thread per process: every piece,
every transfer, the set-up and finishing calls. Where a step's pieces are
short, that issuing is what bounds the step. This measures it on a model so
small that its pieces cost almost nothing (the checker's model,
`jpipe.testing.small_model`, width 32), R fake CPU devices in one process,
1F1B and ZB-H1:

- **ops**: host operations a step (`RankPrograms.last_run["host_ops"]`);
- **issue ms**: the host's time to issue them all (the devices finish later);
  and **us/op**, the two divided;
- **step ms**: until the loss and every gradient are ready;
- the same with each B issued as one fused program (``fused_backward=True``)
  rather than as its I then its W (the default, chosen for memory: see
  docs/design.md), which issues M fewer pieces per rank.

The median of `--steps` steps, each timed alone after a warm-up. On fake CPU
devices the devices share the host's cores with the issuing thread, so the
step column is an upper bound of what the issuing costs a real accelerator;
the issue column is the host's own cost, which a GPU run would pay too.
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

from jpipe import testing  # noqa: E402


def measure(R: int, M: int, name: str, fused: bool, steps: int) -> dict:
    """One row: ops, issue and step seconds (medians) of `name` at R ranks, M microbatches."""
    schedule = jpipe.get_schedule(name, R, M)
    stages, params, make_batch = testing.small_model(schedule.num_stages, seed=0)
    pipe = jpipe.Pipeline(stages, schedule, jpipe.make_mesh(R, 1), lowering="mpmd")
    packed = pipe.pack(params)
    batch = jax.device_put(make_batch(2 * M), pipe.batch_sharding)
    programs = pipe.rank_programs(batch)
    if fused:
        programs = jpipe.RankPrograms(
            schedule,
            pipe.layout,
            pipe.mesh,
            pipe.stage_kernels(batch),
            "pipe",
            "data",
            pipe.tick_plan.stage_to_rank,
            fused_backward=True,
        )
    jax.block_until_ready(programs.run(packed, batch))  # compiles and warms up
    issue, step = [], []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(programs.run(packed, batch))
        step.append(time.perf_counter() - start)
        issue.append(programs.last_run["seconds"])
    ops = programs.last_run["host_ops"]
    return {
        "ranks": R,
        "microbatches": M,
        "schedule": name,
        "backward": "fused B" if fused else "I then W",
        "host_ops": ops,
        "issue_seconds": statistics.median(issue),
        "step_seconds": statistics.median(step),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "zb_h1"])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row")
    args = parser.parse_args(argv)
    print(
        "| ranks | M | schedule | backward | host ops a step | issue ms | us per op | step ms "
        "| issue / step |"
    )
    print("|---:|---:|---|---|---:|---:|---:|---:|---:|")
    for R in args.ranks:
        for M in args.microbatches:
            for name in args.schedules:
                for fused in (False, True):
                    if fused and name != "1f1b":
                        continue  # ZB-H1 issues I and W apart anyway
                    row = measure(R, M, name, fused, args.steps)
                    issue, step, ops = row["issue_seconds"], row["step_seconds"], row["host_ops"]
                    print(
                        f"| {R} | {M} | {name} | {row['backward']} | {ops} | {issue * 1e3:.1f} | "
                        f"{issue / ops * 1e6:.0f} | {step * 1e3:.1f} | {issue / step:.2f} |",
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
