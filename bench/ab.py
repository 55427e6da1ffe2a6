"""Same-run A/B of two jpipe versions: is the compiled program the same, and is it as fast?

``python -m bench.ab --base REV [--model tiny-gpt] [--microbatches 16] [--reps 7]``

Exports the `jpipe` package (and the built-in schedules) of git revision REV
into a temporary folder under the name ``jpipe_base``, so that both versions
live in one process. For each schedule it builds the same workload's training
step with both, then

- compares their optimized HLO (instructions only: the source-location tables
  name other files and lines): "identical" means the two versions run the
  very same program, whatever a timing on a shared machine says;
- times both together, in interleaved rounds (`bench.measure.time_together`),
  and reports the median over rounds of this tree's time over the base's.

For refactors: a change that should not change the program must show
"identical" for every schedule.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile

import jax

SCHEDULES = (("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2), ("gpipe", 1), ("zbv", 2))


def export_base(rev: str, root: str) -> str:
    """``jpipe`` of `rev`, renamed ``jpipe_base``, in a new folder; returns the folder."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    folder = tempfile.mkdtemp(prefix="jpipe_base_")
    archive = subprocess.run(
        ["git", "-C", repo, "archive", rev, "jpipe", "schedules"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    package = os.path.join(folder, "jpipe_base")
    os.rename(os.path.join(folder, "jpipe"), package)
    os.rename(os.path.join(folder, "schedules"), os.path.join(package, "schedules"))
    for dirpath, _, files in os.walk(package):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                with open(path) as f:
                    text = f.read()
                with open(path, "w") as f:
                    f.write(re.sub(r"\bjpipe\b", "jpipe_base", text))
    return folder


def instructions(hlo: str) -> str:
    """The optimized HLO without metadata, source locations and instruction names.

    XLA names an instruction after the JAX operation it came from and numbers
    it in the order of tracing (``%broadcast_in_dim.1148``), so a change in how
    the program is traced renames instructions of the very same program:
    names are replaced by ``%v0, %v1, ...`` in order of first appearance.
    """
    hlo = re.sub(r"jpipe_base", "jpipe", hlo)
    hlo = re.sub(r"metadata=\{[^}]*\}", "", hlo)
    hlo = re.sub(r",? ?stack_frame_id=\d+", "", hlo)
    keep = [
        line for line in hlo.splitlines() if " = " in line or line.startswith(("ENTRY", "%", "}"))
    ]
    names: dict = {}

    def anonymous(match):
        return names.setdefault(match.group(0), f"%v{len(names)}")

    text = re.sub(r"(region|computation)_\d+(\.\d+)*", "region", "\n".join(keep))
    return re.sub(r"%[\w.\-]+", anonymous, text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="the git revision to compare with")
    parser.add_argument("--model", default="tiny-gpt", help="workload (bench.workloads)")
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--reps", type=int, default=7, help="timed rounds (0: compare HLO only)")
    args = parser.parse_args(argv)

    jax.config.update("jax_num_cpu_devices", 4)
    sys.path.insert(0, export_base(args.base, os.getcwd()))
    base = importlib.import_module("jpipe_base")
    import jpipe  # noqa: PLC0415 (after the device count is set)
    from bench import measure  # noqa: PLC0415
    from bench.workloads import get_workload  # noqa: PLC0415

    work = get_workload(args.model)
    devices = jax.devices()[:4]
    M = args.microbatches
    programs, same = [], {}
    for name, chunks in SCHEDULES:
        texts = []
        for tag, lib in (("base", base), ("this", jpipe)):
            schedule = lib.get_schedule(name, 4, M, chunks if chunks > 1 else None)
            fns, params = work.stages(schedule.num_stages)
            pipe = lib.Pipeline(fns, schedule, lib.make_mesh(4, 1, devices))
            packed = pipe.pack(params)
            batch = jax.device_put(work.batch(M), pipe.batch_sharding)
            program = measure.compile_program(
                f"{name} {tag}", jax.jit(pipe.step_fn(batch)), (packed, batch)
            )
            texts.append(instructions(program.fn.as_text()))
            programs.append(program)
        same[name] = texts[0] == texts[1]
        print(f"{name}: {'identical' if same[name] else 'DIFFERENT'} optimized HLO", flush=True)
    if args.reps:
        times = measure.time_together(programs, args.reps, warmup=1)
        for name, _ in SCHEDULES:
            this, old = times[f"{name} this"], times[f"{name} base"]
            ratio = measure.median([a / b for a, b in zip(this, old)])
            print(
                f"{name}: this {measure.median(this) * 1e3:.1f} ms, base "
                f"{measure.median(old) * 1e3:.1f} ms, this / base {ratio:.3f}"
            )
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
