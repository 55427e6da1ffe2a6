"""Step time of memory actions under the per-rank lowering, against their base schedules.

``python -m bench.memory_actions_time [--steps N]`` (about 1 minute on 2 cores)

A small GPT (4 blocks, D = 128, L = 64, 256-token vocabulary) on 4 fake CPU
devices, 4 ranks, M = 8, ``lowering="mpmd"``: 1F1B, ``1f1b_recompute``
(k = 2), ``1f1b_bpipe``, ZB-H1 and ``zb_h1_offload``, each step timed in
turn (the steps of every schedule interleaved, so the machine's noise falls
on all alike), the median of `--steps`, as a ratio to the schedule it adds
actions to, beside the simulator's ratio with unit costs and free copies.

On XLA:CPU host and device memory are the same RAM: an offload's copies are
memcpys on the step's path, which a GPU's copy engines would overlap with
compute. The ratios here are CPU's, not a GPU's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jpipe

if __name__ == "__main__":
    jpipe.use_cpu_devices(4)

import jax  # noqa: E402

from jpipe import models  # noqa: E402
from jpipe.models import gpt  # noqa: E402

CONFIG = gpt.GPTConfig(vocab_size=256, num_layers=4, d_model=128, num_heads=4, seq_len=64, d_ff=512)
# (schedule, options, the schedule it adds memory actions to)
CASES = [
    ("1f1b", {}, "1f1b"),
    ("1f1b_recompute", {"k": 2}, "1f1b"),
    ("1f1b_bpipe", {}, "1f1b"),
    ("zb_h1", {}, "zb_h1"),
    ("zb_h1_offload", {}, "zb_h1"),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7, help="timed steps per schedule")
    args = parser.parse_args(argv)
    R, M = 4, 8
    runs = {}
    for name, options, _ in CASES:
        schedule = jpipe.get_schedule(name, R, M, **options)
        model = models.make_stages(CONFIG, models.split_layers(CONFIG.num_layers, R))
        pipe = jpipe.Pipeline(model.stages, schedule, jpipe.make_mesh(R, 1), lowering="mpmd")
        batch = models.example_batch(CONFIG, batch_size=4 * M, seed=1)
        batch = jax.device_put(batch, pipe.batch_sharding)
        packed = pipe.pack(model.init(0))
        jax.block_until_ready(pipe.value_and_grad(packed, batch))  # compiles
        runs[name] = (pipe, packed, batch, jpipe.simulate(schedule).makespan)
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.steps):
        for name, (pipe, packed, batch, _) in runs.items():
            start = time.perf_counter()
            jax.block_until_ready(pipe.value_and_grad(packed, batch))
            seconds[name].append(time.perf_counter() - start)
    print("| schedule | step ms | measured ratio | simulated ratio |")
    print("|---|---:|---:|---:|")
    for name, _, base in CASES:
        med, base_med = statistics.median(seconds[name]), statistics.median(seconds[base])
        sim = runs[name][3] / runs[base][3]
        print(f"| {name} (vs {base}) | {med * 1e3:.0f} | {med / base_med:.2f}x | {sim:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
