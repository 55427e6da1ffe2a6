"""Pipelining across processes: N processes of one CPU device and one thread each.

Fake CPU devices in one process share the host's cores, so they cannot show a
pipeline's overlap. Separate processes with one XLA thread each
(``--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1``), one
device each, joined by `jax.distributed` over loopback (gloo), are the
closest this machine gets to separate accelerators: each has its own core,
and a transfer goes through the network stack, as between hosts.

``python -m bench.multiprocess`` starts 2 such processes (`jpipe.launch`)
and times, on the same model and global batch, in the same rounds
(`bench.measure.time_together`, so a burst of load elsewhere hits all rows
alike):

- **one process, one thread**: the whole model's step (`jax.value_and_grad`
  of the unpipelined loss on the whole batch) on a process's own device;
  both processes run it at once, each on its own device, as two
  accelerators would; and the same **microbatched** (one microbatch after
  another, `lax.map`);
- F, I, W and B of each of the 2 stages on one microbatch, the same way
  (`bench.profile`);
- jpipe's **1F1B** and **ZB-H1** with one rank per process;
- **data parallel**: the one-device step with the batch split over the 2
  processes and the gradients all-reduced;
- the **transfer** alone: a loop of `ppermute`s of one stage output
  between the two processes.

Every row's loss is compared with the one-process loss (the last column). The predictions
use the measured pieces and transfer: ``sim ideal`` is
``jpipe.simulate(schedule, Costs(F, I, W, B, comm=transfer))`` (ranks that
overlap perfectly); ``sim lock-step`` is the program jpipe compiles,
``plan.predicted_time(costs)`` plus one transfer per channel per tick (every
tick ends in its `ppermute`s).

Process 0 writes what it measured as JSON; the parent writes
``multiprocess.json`` and ``multiprocess.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEDULES = ("1f1b", "zb_h1")
RANKS = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.multiprocess", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", default="dense", help="workload (bench/workloads.py; default dense)")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches M (default 8)")
    p.add_argument("--reps", type=int, default=5, help="timed rounds (default 5)")
    p.add_argument("--out", default="runs/bench-multiprocess", help="output folder")
    p.add_argument("--role", choices=("measure",), help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p


# -- the children ----------------------------------------------------------------


def _local_rows(args, workload, device) -> tuple[list, list]:
    """The whole step on this process's own device, and each stage's pieces there."""
    from bench import measure, profile
    from bench.baselines import one_device, one_device_microbatched

    rows = []
    for name, build in (("one", one_device), ("microbatched", one_device_microbatched)):
        program = build(workload, args.microbatches, RANKS, device)
        rows.append(measure.compile_program(name, program.lowerable, program.args))
    stage_fns, params = workload.stages(RANKS)
    pieces = profile.stage_programs(stage_fns, params, workload.batch(1), device, "stage")
    return rows, pieces


def _transfer_program(workload, mesh):
    """A loop of `ppermute`s of one stage output between the ranks, and its length."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    stage_fns, params = workload.stages(RANKS)
    microbatch = workload.batch(1)
    y = jax.eval_shape(stage_fns[0], params[0], None, microbatch)
    n = mesh.shape["pipe"]
    loops = 20

    def body(x):
        def once(_, x):
            return lax.ppermute(x, "pipe", [(j, (j + 1) % n) for j in range(n)])

        return lax.fori_loop(0, loops, once, x)

    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=P("pipe"), out_specs=P("pipe")),
    )
    shape = (n,) + y.shape
    x = jax.make_array_from_callback(
        shape, NamedSharding(mesh, P("pipe")), lambda idx: jnp.ones(shape, y.dtype)[idx]
    )
    return fn, (x,), loops, list(y.shape)


def _measure(args) -> dict:
    """Every row, timed together in the same rounds, on 2 processes of one device each."""
    import jax

    import jpipe
    from bench import measure, profile
    from bench.baselines import data_parallel
    from bench.workloads import get_workload

    workload = get_workload(args.model)
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    local_rows, pieces = _local_rows(args, workload, jax.local_devices()[0])
    mesh = jpipe.make_mesh(RANKS, 1, devices, across_hosts={"pipe": RANKS})
    programs, info = [], {}
    for name in SCHEDULES:
        sched = jpipe.get_schedule(name, RANKS, args.microbatches)
        stage_fns, params = workload.stages(sched.num_stages)
        pipe = jpipe.Pipeline(stage_fns, sched, mesh)
        packed = pipe.pack(params)
        batch = jax.device_put(workload.batch(args.microbatches), pipe.batch_sharding)
        programs.append(measure.compile_program(f"jpipe {name}", pipe, (packed, batch)))
        info[f"jpipe {name}"] = {"ticks": pipe.plan.num_ticks, "channels": len(pipe.plan.channels)}
    dp = data_parallel(workload, args.microbatches, RANKS, devices)
    programs.append(measure.compile_program("data parallel", dp.lowerable, dp.args))
    fn, targs, loops, block = _transfer_program(workload, mesh)
    transfer = measure.compile_program("transfer", fn, targs)
    times = measure.time_together(local_rows + pieces + programs + [transfer], args.reps, warmup=1)
    rows = {}
    for p in local_rows + programs:
        out = p.fn(*p.args)
        rows[p.name] = {
            "times": times[p.name],
            "compile_seconds": p.compile_seconds,
            "loss": float(out[0]),
            **info.get(p.name, {}),
        }
    return {
        "rows": rows,
        "transfer": {"times": [t / loops for t in times["transfer"]], "block": block},
        "costs": profile.costs_from_times(times, "stage", RANKS),
        "processes": jax.process_count(),
    }


def _child(args) -> int:
    import jax

    import jpipe

    jpipe.initialize_distributed()

    result = _measure(args)
    if jax.process_index() == 0:
        with open(args.result, "w") as f:
            json.dump(result, f)
    return 0


# -- the parent ------------------------------------------------------------------


def _launch(args, role: str, n: int, result: str) -> dict:
    import jpipe

    command = [
        "-m", "bench.multiprocess", "--role", role, "--result", result,
        "--model", args.model, "--microbatches", str(args.microbatches), "--reps", str(args.reps),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    status = jpipe.launch_local(command, n, cpu_devices=1, one_thread=True, env=env)
    if status:
        raise SystemExit(f"error: the {role} phase failed with status {status}")
    with open(result) as f:
        return json.load(f)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def report(multi: dict, args, seconds: float) -> tuple[dict, str]:
    """The table (markdown) and everything measured (JSON-ready)."""
    import statistics

    import jpipe

    med = statistics.median
    costs = multi["costs"]
    transfer = med(multi["transfer"]["times"])
    c = jpipe.Costs(F=costs["F"], I=costs["I"], W=costs["W"], B=costs["B"], comm=transfer)
    base = multi["rows"]["one"]
    base_med, base_best = med(base["times"]), min(base["times"])
    dp = multi["rows"]["data parallel"]
    lines = [
        "| row | processes | compile s | step ms (median / best) | vs one process | "
        "vs 2-process data parallel | sim ideal ms | sim lock-step ms | sum of pieces ms | "
        "loss rel. diff |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    table = {}

    def add(name, procs, row, ideal="-", lockstep="-", work="-"):
        t = row["times"]
        rel = abs(row["loss"] - base["loss"]) / abs(base["loss"])
        lines.append(
            f"| {name} | {procs} | {row['compile_seconds']:.2f} | {_ms(med(t))} / {_ms(min(t))} | "
            f"{med(t) / base_med:.2f} / {min(t) / base_best:.2f}x | "
            f"{med(t) / med(dp['times']):.2f} / {min(t) / min(dp['times']):.2f}x | "
            f"{ideal} | {lockstep} | {work} | {rel:.1e} |"
        )
        table[name] = {**row, "loss_rel_diff": rel}

    M = args.microbatches
    total = {kind: M * sum(costs[kind]) for kind in costs}
    add("one process, one thread", 1, base)
    add(
        "one process, microbatched", 1, multi["rows"]["microbatched"],
        work=_ms(total["F"] + total["B"]),
    )  # fmt: skip
    add("data parallel", 2, dp)
    for name in SCHEDULES:
        row = multi["rows"][f"jpipe {name}"]
        sched = jpipe.get_schedule(name, RANKS, args.microbatches)
        plan = jpipe.make_plan(sched)
        ideal = jpipe.simulate(sched, c).makespan
        lockstep = plan.predicted_time(c) + plan.num_ticks * len(plan.channels) * transfer
        work = total["F"] + (total["B"] if name == "1f1b" else total["I"] + total["W"])
        add(f"jpipe {name}", 2, row, _ms(ideal), _ms(lockstep), _ms(work))
        table[f"jpipe {name}"].update(sim_ideal=ideal, sim_lockstep=lockstep)
    pieces = ", ".join(
        f"stage {s}: F {_ms(costs['F'][s])}, I {_ms(costs['I'][s])}, W {_ms(costs['W'][s])}, "
        f"B {_ms(costs['B'][s])}"
        for s in range(RANKS)
    )
    block = "x".join(map(str, multi["transfer"]["block"]))
    md = "\n".join(
        [
            f"Model `{args.model}`, M = {args.microbatches} microbatches, {args.reps} rounds, "
            f"{seconds:.0f} s in all.",
            "",
            *lines,
            "",
            f"Pieces (ms, one microbatch, one thread): {pieces}.",
            f"Transfer: one stage output ({block} float32) between the two processes: "
            f"{_ms(transfer)} ms (median of {len(multi['transfer']['times'])} rounds of a "
            f"loop of ppermutes).",
        ]
    )
    data = {
        "model": args.model,
        "microbatches": args.microbatches,
        "reps": args.reps,
        "costs": costs,
        "transfer_seconds": transfer,
        "rows": table,
    }
    return data, md


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.role:
        return _child(args)
    start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        multi = _launch(args, "measure", RANKS, os.path.join(tmp, "measure.json"))
    data, md = report(multi, args, time.perf_counter() - start)
    with open(os.path.join(args.out, "multiprocess.json"), "w") as f:
        json.dump(data, f, indent=1)
    with open(os.path.join(args.out, "multiprocess.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
