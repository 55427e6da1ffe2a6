"""The planner's memory against what train.py compiles, for plans the planner made.

``python -m bench.planner_memory [--json]``

1. ``train.py --config.profile=True`` on 4 fake CPU devices (the default
   GPT, pipe=4, 8 microbatches of 4 sequences) writes ``profile.json``: each
   stage's times, parameters, residual and output bytes, and the runtime's
   memory terms as this run measured them (`jpipe.train.profile.measured_memory_terms`).
2. ``python -m jpipe.plan --profiles profile.json`` plans the same model for
   other devices, batches and memories (``--tensor-parallel 1``: the profile
   has no other degree to derive from), and ``--save`` writes each winner.
3. ``train.py --config.plan=FILE`` trains each plan for one step and prints
   the compiled step's per-device arguments, temporaries and outputs beside
   the plan's ``footprint_bytes`` (`jpipe.train.profile.plan_memory_line`).

The table: per plan, the planner's footprint of the fullest device (the
``spmd`` layout, as jpipe's one program allocates), the compiled bytes
(arguments + temporaries + outputs not reusing a donated argument) and their
ratio. The first row is the profiled setup itself, where the ratio is 1 by
construction (the working factor is measured there); the others are what the
memory model predicts for setups it did not see.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

# (devices, global batch, microbatch sizes to try, memory per device in bytes)
SETUPS = (
    ("cpu:4", 32, "4", 6e7),  # the profiled setup
    ("cpu:8", 32, "4", 6e7),
    ("cpu:8", 64, "4", 6e7),
    ("cpu:4", 64, "8", 1e8),
    ("cpu:4", 32, "2", 3e7),
    ("cpu:2", 32, "4", 7e7),
    ("cpu:2", 32, "4", 1e8),
)
LINE = re.compile(
    r"the compiled step holds ([\d,.]+) MiB per device \(arguments ([\d,.]+) MiB, temporaries "
    r"([\d,.]+) MiB, outputs ([\d,.]+) MiB \(([\d,.]+) MiB reusing donated arguments\)\); "
    r"the plan's footprint is ([\d,.]+) MiB"
)


def _run(argv: list[str], log) -> str:
    out = subprocess.run(argv, capture_output=True, text=True, check=False)
    if out.returncode:
        log(out.stdout + out.stderr)
        raise RuntimeError(f"{' '.join(argv)} exited with {out.returncode}")
    return out.stdout + out.stderr


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    py = sys.executable
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = os.path.join(tmp, "profile")
        log("profiling the default GPT on 4 fake CPU devices (pipe=4, M=8)")
        base = ["--config=configs/default.py", "--config.steps=1", "--config.eval_every=0"]
        _run([py, "train.py", *base, f"--workdir={work}", "--config.mesh.data=1",
              "--config.profile=True"], log)  # fmt: skip
        profile = os.path.join(work, "profile.json")
        for i, (devices, batch, sizes, memory) in enumerate(SETUPS):
            plan_path = os.path.join(tmp, f"plan{i}.json")
            _run([py, "-m", "jpipe.plan", "--model", "gpt", "--profiles", profile,
                  "--devices", devices, "--global-batch", str(batch), "--microbatch-sizes",
                  sizes, "--memory", f"cpu:{memory:g}", "--tensor-parallel", "1", "--top", "1",
                  "--save", plan_path], log)  # fmt: skip
            with open(plan_path) as f:
                plan = json.load(f)
            mesh = plan["mesh"]
            log(f"{devices} batch {batch}: pp={mesh['pipe']} dp={mesh['data']}, training a step")
            text = _run([py, "train.py", *base, f"--workdir={os.path.join(tmp, f'run{i}')}",
                         f"--config.plan={plan_path}"], log)  # fmt: skip
            found = LINE.search(text)
            if not found:
                log(text)
                raise RuntimeError("train.py printed no memory line for the plan")
            mib = [float(x.replace(",", "")) for x in found.groups()]
            rows.append(
                {
                    "devices": devices,
                    "global_batch": batch,
                    "pipe": mesh["pipe"],
                    "data": mesh["data"],
                    "microbatch_size": plan["microbatch_size"],
                    "num_microbatches": plan["num_microbatches"],
                    "blocks_per_stage": plan["blocks_per_stage"],
                    "compiled_mib": mib[0],
                    "arguments_mib": mib[1],
                    "temp_mib": mib[2],
                    "outputs_mib": mib[3],
                    "aliased_mib": mib[4],
                    "footprint_mib": mib[5],
                    "ratio": mib[5] / mib[0],
                }
            )
    if args.json:
        print(json.dumps({"rows": rows}))
        return 0
    print(
        "| devices | global batch | pp x dp | B x M | blocks per stage | arguments MiB "
        "| temp MiB | outputs (reused) MiB | compiled MiB | planner MiB | planner / compiled |"
    )
    print("|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['devices']} | {r['global_batch']} | {r['pipe']} x {r['data']} "
            f"| {r['microbatch_size']} x {r['num_microbatches']} | {r['blocks_per_stage']} "
            f"| {r['arguments_mib']:.1f} | {r['temp_mib']:.1f} | {r['outputs_mib']:.1f} "
            f"({r['aliased_mib']:.1f}) | {r['compiled_mib']:.1f} | {r['footprint_mib']:.1f} "
            f"| {r['ratio']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
