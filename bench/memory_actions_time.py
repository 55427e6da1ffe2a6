"""Step time of schedules that trade time for memory, against the schedule they save on.

``python -m bench.memory_actions_time [--lowering spmd|mpmd] [--steps N] [--json]``
(about 2 minutes on 2 cores)

A small GPT (8 blocks, D = 128, L = 64, 256-token vocabulary) on 4 fake CPU
devices, 4 ranks, M = 8, either lowering: 1F1B, ``1f1b_recompute`` (k = 2)
and ``1f1b_bpipe`` against 1F1B; ZB-H1 and ``zb_h1_offload`` against ZB-H1;
ZB-V, V-Half and V-Min (two stages a rank) against 1F1B. Each step is timed
in turn (the steps of every schedule interleaved, so the machine's noise
falls on all alike), the median of `--steps`, as a ratio to its base
schedule's, beside two simulated ratios: ``jpipe.simulate``'s makespan with
unit costs (F = I = W = 1, B = 2 a stage; a V stage is half a stage, so
F = I = W = 1/2 there; a recompute costs F; copies free) and, for the SPMD
lowering, the lock-step time of its compiled plan (`TickPlan.predicted_time`,
the same costs: every tick costs its slowest rank).

On XLA:CPU host and device memory are the same RAM: an offload's copies are
memcpys on the step's path, which a GPU's copy engines would overlap with
compute. In the SPMD program every lane of evictions moves a residual every
tick (its collective runs unconditionally). The fake devices share two
cores, so a step shows work and copies, not the overlap of ranks. The ratios
here are CPU's, not a GPU's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jpipe

if __name__ == "__main__":
    jpipe.use_cpu_devices(4)

import jax  # noqa: E402

from jpipe import models  # noqa: E402
from jpipe.models import gpt  # noqa: E402
from jpipe.search.engine import spec_text  # noqa: E402  (``zbv:max_deferred_w=0``)

CONFIG = gpt.GPTConfig(vocab_size=256, num_layers=8, d_model=128, num_heads=4, seq_len=64, d_ff=512)
# (schedule, options, stages per rank, the schedule it saves memory on)
CASES = [
    ("1f1b", {}, 1, "1f1b"),
    ("1f1b_recompute", {"k": 2}, 1, "1f1b"),
    ("1f1b_bpipe", {}, 1, "1f1b"),
    ("zb_h1", {}, 1, "zb_h1"),
    ("zb_h1_offload", {}, 1, "zb_h1"),
    ("zbv", {}, 2, "1f1b"),
    ("zbv", {"max_deferred_w": 0}, 2, "1f1b"),
    ("vhalf", {}, 2, "1f1b"),
    ("vmin", {}, 2, "1f1b"),
]
R, M = 4, 8


def unit_costs(chunks: int) -> jpipe.Costs:
    """F = I = W = 1 a stage of the 1F1B split (B = 2), a half of that for a V's half stage."""
    c = 1.0 / chunks
    return jpipe.Costs(F=c, I=c, W=c, B=2 * c)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7, help="timed steps per schedule")
    parser.add_argument("--lowering", choices=jpipe.LOWERINGS, default="spmd")
    parser.add_argument("--json", action="store_true", help="print one JSON list")
    args = parser.parse_args(argv)
    runs = {}
    for name, options, chunks, _ in CASES:
        spec = spec_text(name, options)
        schedule = jpipe.get_schedule(name, R, M, chunks if chunks > 1 else None, **options)
        model = models.make_stages(CONFIG, models.split_layers(CONFIG.num_layers, R * chunks))
        pipe = jpipe.Pipeline(model.stages, schedule, jpipe.make_mesh(R, 1), lowering=args.lowering)
        batch = models.example_batch(CONFIG, batch_size=4 * M, seed=1)
        batch = jax.device_put(batch, pipe.batch_sharding)
        packed = pipe.pack(model.init(0))
        jax.block_until_ready(pipe.value_and_grad(packed, batch))  # compiles
        costs = unit_costs(chunks)
        lockstep = pipe.tick_plan.predicted_time(costs) if args.lowering == "spmd" else None
        runs[spec] = (pipe, packed, batch, jpipe.simulate(schedule, costs).makespan, lockstep)
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.steps):
        for name, (pipe, packed, batch, *_) in runs.items():
            start = time.perf_counter()
            jax.block_until_ready(pipe.value_and_grad(packed, batch))
            seconds[name].append(time.perf_counter() - start)
    rows = []
    for name, options, _, base in CASES:
        name = spec_text(name, options)
        med, base_med = statistics.median(seconds[name]), statistics.median(seconds[base])
        _, _, _, sim, lockstep = runs[name]
        _, _, _, base_sim, base_lockstep = runs[base]
        rows.append(
            {
                "schedule": name,
                "base": base,
                "lowering": args.lowering,
                "step_ms": med * 1e3,
                "measured_ratio": med / base_med,
                "simulated_ratio": sim / base_sim,
                "lockstep_ratio": None if lockstep is None else lockstep / base_lockstep,
            }
        )
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"lowering={args.lowering}, {R} ranks, M = {M}, median of {args.steps} steps")
    print("| schedule | step ms | measured ratio | simulated ratio | lock-step ratio |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        lock = "" if row["lockstep_ratio"] is None else f"{row['lockstep_ratio']:.2f}x"
        print(
            f"| {row['schedule']} (vs {row['base']}) | {row['step_ms']:.0f} | "
            f"{row['measured_ratio']:.2f}x | {row['simulated_ratio']:.2f}x | {lock} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
