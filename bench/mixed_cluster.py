"""The planner's predicted step of a mixed-cluster plan beside the step measured on the stand-in.

``python -m bench.mixed_cluster [--steps N]``

1. ``train.py --config.profile=True`` measures a small GPT of 3 one-block
   stages (pipe 3, tensor 1, one process) and writes ``profile.json``.
2. The planner evaluates two per-rank plans of that profile for 3 hosts:
   ranks of tensor 1, 2 and 1 (the mixed plan: the planner derives tensor 2
   from tensor 1 as ``1/T``, the profile having no other degree), and all of
   tensor 1 (the control), and writes their plan files.
3. Each plan trains for ``--steps`` steps as its 3 processes (``python -m
   jpipe.launch``: the mixed plan with ``--plan``, its hosts faking 1, 2 and 1
   CPU devices; the control with 1 each), and the median step ``train.py``
   prints is read beside the plan's ``predicted_seconds``.

What the stand-in cannot show: fake CPU devices share this machine's cores,
so a tensor-parallel pair computes no faster than one device (the 1/T the
planner assumes for a GPU pair), and the transfers between processes go over
loopback, not a network; the processes' host work (dispatch, the
coordination service's barrier each step) is real. The table says how far
each prediction is from its measurement on this machine, not on a cluster.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = [
    "--config.data.max_bytes=65536",
    "--config.model.seq_len=64",
    "--config.model.num_layers=3",
    "--config.model.d_model=128",
    "--config.model.d_ff=512",
    "--config.model.num_heads=4",
]
STEP = re.compile(r"median step ([\d,.]+) ms")


def _run(argv: list[str]) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=env, check=False)
    if out.returncode:
        sys.stderr.write(out.stdout[-3000:] + out.stderr[-3000:])
        raise RuntimeError(f"{' '.join(argv)} exited with {out.returncode}")
    return out.stdout + out.stderr


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="steps each plan trains")
    args = parser.parse_args(argv)

    from jpipe.planner import ClusterPlan, DeviceGroup, evaluate, load_profile, plan_file

    work = tempfile.mkdtemp(prefix="jpipe-mixed-")
    train = [sys.executable, os.path.join(ROOT, "train.py")]
    # 4 microbatches of 3 sequences: the batch divides over the control's 3 processes.
    common = ["--config.batch_size=12", "--config.num_microbatches=4", *MODEL]
    _run(
        [*train, f"--workdir={work}/profiled", "--config.profile=True", "--config.steps=3",
         "--config.mesh.pipe=3", "--config.mesh.data=1", "--config.eval_batches=1", *common]
    )  # fmt: skip
    profile = load_profile(os.path.join(work, "profiled", "profile.json"))
    profile = dataclasses.replace(profile, memory={"cpu": 1e9}, derived=set(), _links={})
    rows = []
    for name, degrees in (
        ("mixed: tensor 1, 2, 1", (1, 2, 1)),
        ("control: tensor 1, 1, 1", (1,) * 3),
    ):
        ranks = tuple(
            (DeviceGroup("cpu", tensor_parallel=t, node=i),) for i, t in enumerate(degrees)
        )
        ev = evaluate(
            ClusterPlan(ranks, ((0,), (1,), (2,)), 3, 12, "1f1b", memory_layout="mpmd"), profile
        )
        path = os.path.join(work, f"plan{''.join(map(str, degrees))}.json")
        with open(path, "w") as f:
            json.dump(plan_file(ev, profile), f)
        launch = [sys.executable, "-m", "jpipe.launch", "--timeout", "900"]
        launch += ["--plan", path] if len(set(degrees)) > 1 else ["-n", "3", "--cpu_devices", "1"]
        out = _run(
            [*launch, "--", "train.py", f"--workdir={work}/{name[:5]}", f"--config.plan={path}",
             f"--config.steps={args.steps}", f"--config.eval_every={args.steps}",
             "--config.eval_batches=1", f"--config.checkpoint_every={args.steps}", *MODEL]
        )  # fmt: skip
        measured = float(STEP.findall(out)[-1].replace(",", "")) / 1e3
        rows.append((name, ev.step_seconds, measured))
    print(
        "| plan (3 processes, 1F1B, M = 4 of 3 sequences) | predicted step ms "
        "| measured median step ms | measured / predicted |"
    )
    print("|---|---:|---:|---:|")
    for name, predicted, measured in rows:
        ratio = measured / predicted
        print(f"| {name} | {predicted * 1e3:.1f} | {measured * 1e3:.1f} | {ratio:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
