"""Pipelining across processes: N processes of one CPU device and one thread each.

Fake CPU devices in one process share the host's cores, so they cannot show a
pipeline's overlap. Separate processes with one XLA thread each
(``--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1``),
each pinned to a core of its own (`jpipe.launch_local`'s ``one_thread``:
XLA:CPU sizes its thread pools by the cores a process may use, so without
the pin each ran four busy threads), one device each, joined by
`jax.distributed` over loopback (gloo), are the closest this machine gets
to separate accelerators: each computes on its own core, and a transfer
goes through the network stack, as between hosts. The process's host
thread and its transfer threads share that core too, which a host of
accelerators does not make them do.

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
- jpipe's **1F1B** and **ZB-H1** with one rank per process, under each
  lowering: the SPMD program (rows ``jpipe NAME``) and the per-rank
  programs issued from each process's host (rows ``jpipe NAME per-rank``;
  a B runs as its I and then its W there);
- **data parallel**: the one-device step with the batch split over the 2
  processes and the gradients all-reduced;
- the **transfer** alone: a loop of `ppermute`s of one stage output
  between the two processes (what the SPMD program sends with), and a
  ping-pong of the same block through JAX's transfer API (what the
  per-rank lowering sends with; `jpipe.RankPrograms.courier`).

Every row's loss is compared with the one-process loss (the last column). The predictions
use the measured pieces and transfer: ``sim ideal`` is
``jpipe.simulate(schedule, Costs(F, I, W, B, comm=transfer))`` (ranks that
overlap perfectly; for the per-rank rows with that lowering's own compiled
F, I and W, each timed as M calls issued back to back as a step issues
them, B = I + W, as they run it; the ppermutes' transfer time for both,
since with one core a process the transfer API's ping-pong times a
thread's wake-up more than the link); ``sim
lock-step`` is the program jpipe compiles, ``plan.predicted_time(costs)``
plus one transfer per channel per tick (every
tick ends in its `ppermute`s). For the per-rank rows the host's own cost is
reported too: operations issued per step (pieces, transfers, set-up calls)
and the host's time to issue them, per operation.

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

from bench import docs

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
    docs.add_flag(p, DOCS_PAGE)
    return p


DOCS_PAGE = "docs/benchmarks.md"


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


def _transfer_api_program(pipe, batch, block, loops: int):
    """A ping-pong of one ``block`` between the ranks through the per-rank lowering's courier."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    programs = pipe.rank_programs(batch)
    courier = programs.courier
    structs = [
        [jax.ShapeDtypeStruct((1,) + tuple(block), jnp.float32, sharding=NamedSharding(m, P()))]
        for m in programs.meshes
    ]
    x = None
    if courier.local[0]:
        x = [jax.device_put(jnp.ones((1,) + tuple(block), jnp.float32), structs[0][0].sharding)]

    def ping_pong(x):
        courier.begin()
        for i in range(loops):
            x = courier.move(x, 0, 1, 2 * i, structs[1])
            x = courier.move(x, 1, 0, 2 * i + 1, structs[0])
        return x or []  # process 0 waits for the last one back; process 1 only issues

    return ping_pong, (x,)


class _Piece:
    """One compiled piece of the per-rank lowering, called again and again with its own arguments.

    A donated argument (a W's gradient accumulator, the last stage's loss
    sums) is replaced by the call's matching output, as the step does.
    """

    def __init__(self, exe, args, donated: int | None, out: int):
        self.exe, self.args, self.donated, self.out = exe, list(args), donated, out

    def __call__(self):
        result = self.exe(*self.args)
        if self.donated is not None:
            self.args[self.donated] = result[self.out] if self.out >= 0 else result
        return result


def _per_rank_pieces(rank_programs, step_args, calls: int) -> list:
    """The F, I and W of this process's stage as the per-rank lowering compiled them, as rows.

    Their arguments are those of a real step's first call of each (copied
    before the call, which may donate them). A row issues its piece `calls`
    times (M, as often as a step runs it) and waits for the last: as in the
    step, where a rank's pieces are issued back to back and nobody waits
    between them, so one wait's latency is spread over M calls, not paid
    by each. Its time over `calls` is the piece's cost in the step.
    """
    import jax

    from bench import measure

    captured, originals = {}, {}
    for (s, r), table in rank_programs.compiled.items():
        for kind, exe in table.items():
            originals[(s, r, kind)] = exe

            def wrap(*a, exe=exe, key=(s, r, kind)):
                if key not in captured:
                    captured[key] = jax.tree.map(
                        lambda x: x.copy() if isinstance(x, jax.Array) else x, list(a)
                    )
                return exe(*a)

            table[kind] = wrap
    try:
        jax.block_until_ready(rank_programs.run(*step_args))
    finally:
        for (s, r, kind), exe in originals.items():
            rank_programs.compiled[s, r][kind] = exe
    last = rank_programs.num_stages - 1
    rows = []
    for (s, r, kind), a in sorted(captured.items()):
        if kind not in ("F", "I", "W"):
            continue
        donated, out = {"W": (5, -1), "F": (4, 2) if s == last else (None, 0)}.get(kind, (None, 0))
        piece = _Piece(originals[(s, r, kind)], a, donated, out)
        rows.append(
            measure.Compiled(
                f"per-rank {kind}",
                lambda p=piece: [p() for _ in range(calls)][-1],
                (), 0.0, None, None, None,
            )
        )  # fmt: skip
    return rows


def _measure(args) -> dict:
    """Every row, timed together in the same rounds, on 2 processes of one device each."""
    import jax
    import numpy as np

    import jpipe
    from bench import measure, profile
    from bench.baselines import data_parallel
    from bench.workloads import get_workload

    workload = get_workload(args.model)
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    local_rows, pieces = _local_rows(args, workload, jax.local_devices()[0])
    mesh = jpipe.make_mesh(RANKS, 1, devices, across_hosts={"pipe": RANKS})
    programs, info, per_rank = [], {}, {}
    for name in SCHEDULES:
        sched = jpipe.get_schedule(name, RANKS, args.microbatches)
        stage_fns, params = workload.stages(sched.num_stages)
        pipe = jpipe.Pipeline(stage_fns, sched, mesh)
        packed = pipe.pack(params)
        batch = jax.device_put(workload.batch(args.microbatches), pipe.batch_sharding)
        programs.append(measure.compile_program(f"jpipe {name}", pipe, (packed, batch)))
        info[f"jpipe {name}"] = {
            "ticks": pipe.tick_plan.num_ticks,
            "channels": len(pipe.tick_plan.channels),
        }
        mpmd = jpipe.Pipeline(stage_fns, sched, mesh, lowering="mpmd")
        packed = mpmd.pack(params)
        start = time.perf_counter()
        per_rank[name] = (mpmd.compile(packed, batch), (packed, batch))
        programs.append(
            measure.Compiled(
                f"jpipe {name} per-rank", mpmd.value_and_grad, (packed, batch),
                time.perf_counter() - start, None, None, None,
            )
        )  # fmt: skip
    dp = data_parallel(workload, args.microbatches, RANKS, devices)
    programs.append(measure.compile_program("data parallel", dp.lowerable, dp.args))
    fn, targs, loops, block = _transfer_program(workload, mesh)
    transfer = measure.compile_program("transfer", fn, targs)
    ping_pong, pargs = _transfer_api_program(mpmd, batch, block, loops)
    api = measure.Compiled("transfer api", ping_pong, pargs, 0.0, None, None, None)
    # One stage per process: the same rows in each.
    own = _per_rank_pieces(*per_rank["1f1b"], calls=args.microbatches)
    times = measure.time_together(
        local_rows + pieces + own + programs + [transfer, api], args.reps, warmup=1
    )
    from jax.experimental import multihost_utils

    mine = np.array([[np.median(times[f"per-rank {k}"]) / args.microbatches for k in "FIW"]])
    every = multihost_utils.process_allgather(mine, tiled=True)  # [stage, (F, I, W)]
    for name, (rank_programs, step_args) in per_rank.items():  # the host's side of a step
        host_seconds = []
        for _ in range(args.reps):
            jax.block_until_ready(rank_programs.run(*step_args))
            host_seconds.append(rank_programs.last_run["seconds"])
        info[f"jpipe {name} per-rank"] = {
            "host_ops": rank_programs.last_run["host_ops"],
            "host_seconds": host_seconds,
            "transfers_between_processes": rank_programs.last_run["transfers_between_processes"],
        }
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
        "transfer_api": {"times": [t / (2 * loops) for t in times["transfer api"]]},
        "costs": profile.costs_from_times(times, "stage", RANKS),
        "per_rank_costs": {k: [float(v) for v in every[:, i]] for i, k in enumerate("FIW")},
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
    api = med(multi["transfer_api"]["times"])
    c = jpipe.Costs(F=costs["F"], I=costs["I"], W=costs["W"], B=costs["B"], comm=transfer)
    # The per-rank lowering runs its own pieces (F, I and W as it compiled them, timed in the
    # same rounds) and issues a B as its I and then its W. Its ideal takes the link's cost
    # as the ppermutes measure it, as the SPMD rows' does: with one core a process, the
    # transfer API's ping-pong measures how soon a thread sharing its core with a busy one
    # wakes (25 to 92 ms a transfer, where a whole step of 17 transfers took 380 ms), not
    # what a transfer costs inside a step.
    own = multi["per_rank_costs"]
    i_then_w = [i + w for i, w in zip(own["I"], own["W"])]
    c_per_rank = jpipe.Costs(F=own["F"], I=own["I"], W=own["W"], B=i_then_w, comm=transfer)
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
    hosts = []
    add("one process, one thread", 1, base)
    add(
        "one process, microbatched", 1, multi["rows"]["microbatched"],
        work=_ms(total["F"] + total["B"]),
    )  # fmt: skip
    add("data parallel", 2, dp)
    for name in SCHEDULES:
        row = multi["rows"][f"jpipe {name}"]
        sched = jpipe.get_schedule(name, RANKS, args.microbatches)
        plan = jpipe.make_tick_plan(sched)
        ideal = jpipe.simulate(sched, c).makespan
        lockstep = plan.predicted_time(c) + plan.num_ticks * len(plan.channels) * transfer
        work = total["F"] + (total["B"] if name == "1f1b" else total["I"] + total["W"])
        add(f"jpipe {name}", 2, row, _ms(ideal), _ms(lockstep), _ms(work))
        table[f"jpipe {name}"].update(sim_ideal=ideal, sim_lockstep=lockstep)
        key = f"jpipe {name} per-rank"
        row = multi["rows"][key]
        ideal = jpipe.simulate(sched, c_per_rank).makespan
        work = M * sum(own["F"] + own["I"] + own["W"])
        add(key, 2, row, _ms(ideal), "-", _ms(work))
        table[key].update(
            sim_ideal=ideal, vs_ideal=[med(row["times"]) / ideal, min(row["times"]) / ideal]
        )
        host = med(row["host_seconds"])
        hosts.append(
            f"{key}: {row['host_ops']} host operations a step "
            f"({row['transfers_between_processes']} of them transfers between the processes), "
            f"issued in {_ms(host)} ms "
            f"({host / row['host_ops'] * 1e6:.0f} us each); step / sim ideal "
            f"{med(row['times']) / ideal:.2f} (median) / {min(row['times']) / ideal:.2f} (best)"
        )
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
            "The per-rank lowering's own pieces (its compiled F, I and W, same rounds, "
            f"each issued {args.microbatches} times back to back as in a step, per call): "
            + ", ".join(
                f"stage {s}: F {_ms(own['F'][s])}, I {_ms(own['I'][s])}, W {_ms(own['W'][s])}"
                for s in range(RANKS)
            )
            + ".",
            f"Transfer: one stage output ({block} float32) between the two processes: "
            f"{_ms(transfer)} ms (median of {len(multi['transfer']['times'])} rounds of a "
            f"loop of ppermutes); through JAX's transfer API {_ms(api)} ms (median of a "
            "ping-pong).",
            "",
            "Per-rank lowering, the host's side (process 0, median of the rounds):",
            "",
            *(f"- {line}" for line in hosts),
        ]
    )
    data = {
        "model": args.model,
        "microbatches": args.microbatches,
        "reps": args.reps,
        "costs": costs,
        "transfer_seconds": transfer,
        "transfer_api_seconds": api,
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
    if args.write_docs:
        name = f"multiprocess-m{args.microbatches}"
        docs.write(DOCS_PAGE, name, md, docs.command_line("bench.multiprocess", argv))
        print(f"wrote block {name!r} of {DOCS_PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
