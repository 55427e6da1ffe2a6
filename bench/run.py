"""The benchmark table: jpipe against the unpipelined model and the peer.

For each microbatch count M (microbatches of a fixed size, so the global
batch grows with M), one group of rows runs the same model on the same batch:
the one-device step, data parallelism, the peer (GPipe, and circular when
``M >= R``) and jpipe with each schedule. The group is compiled row by row,
every row's loss is checked against the one-device loss, and then the rows
are timed together (`bench.measure.time_together`).

Each jpipe row also gets the simulator's predictions from per-stage costs
measured by `bench.profile`: ``simulate(...).makespan`` (ranks that overlap
perfectly), ``plan.predicted_time`` (the lock-step program jpipe compiles: each
tick costs its slowest rank's piece) and the total work (the sum of every
piece, what one device would spend; on fake CPU devices, which share the
host's cores, this and not the makespan is the time to expect).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys
import traceback

import jax

import jpipe
from bench import measure, profile, report, rows
from bench.workloads import get_workload, workload_names

DEFAULT_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv")


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description=(
            "Benchmark jpipe against one device, data parallelism and the vmap-style SPMD "
            "GPipe pipeline; writes bench.json, bench.md and bench.png to --out."
        ),
    )
    p.add_argument(
        "--suite",
        choices=("table", "compiler", "memory"),
        default="table",
        help="table: the benchmark table (default); compiler: memory and compile time "
        "against microbatches and the per-tick overhead, on the compiler issue's shape; "
        "memory: GPT-2-small shapes compiled (not run), per-device bytes against the need",
    )
    p.add_argument(
        "--quick", action="store_true", help="small model, fewer rows and reps (< 5 min on 2 cores)"
    )
    p.add_argument("--out", default="runs/bench", help="output folder (default runs/bench)")
    p.add_argument(
        "--model", choices=workload_names(), help="workload (default gpt; quick: tiny-gpt)"
    )
    p.add_argument(
        "--microbatches", type=_ints, help="microbatch counts (default 8,32,128; quick: 4,16)"
    )
    p.add_argument(
        "--schedules", type=_names, help=f"jpipe schedules (default {','.join(DEFAULT_SCHEDULES)})"
    )
    p.add_argument(
        "--ranks", type=int, default=4, help="pipeline ranks, and devices for every row (4)"
    )
    p.add_argument(
        "--chunks", type=int, default=2, help="stages per rank for interleaved and V schedules (2)"
    )
    p.add_argument(
        "--reps", type=int, help="timed repetitions per row (default 7, compiler suite 9; quick: 3)"
    )
    p.add_argument(
        "--large-reps",
        type=int,
        default=3,
        help="repetitions for groups of 64 or more microbatches, whose steps are long (3)",
    )
    p.add_argument(
        "--compile-reps", type=int, help="compiler suite: compiles per point (default 3; quick: 1)"
    )
    p.add_argument(
        "--perf-microbatches",
        type=int,
        help="compiler suite: microbatches of the performance shape (default 16; quick: 8)",
    )
    p.add_argument("--no-peer", action="store_true", help="leave out the peer rows")
    p.add_argument("--no-plot", action="store_true", help="do not draw bench.png")
    p.add_argument("--json", action="store_true", help="memory suite: print one JSON list")
    p.add_argument(
        "--write-docs",
        action="store_true",
        help="also replace the suite's table in its docs page: table -> docs/benchmarks.md "
        "(block bench-table), compiler and memory -> docs/compiler-measurements.md "
        "(blocks compiler-suite, memory-suite)",
    )
    return p


def settle(args: argparse.Namespace) -> argparse.Namespace:
    """Fills the defaults that depend on --quick."""
    quick = args.quick
    if args.suite == "compiler":
        args.model = args.model or ("tiny-dense" if quick else "dense")
        args.microbatches = args.microbatches or ((4, 8, 16) if quick else (8, 16, 32, 64))
        args.schedules = args.schedules or DEFAULT_SCHEDULES
        args.reps = args.reps or (3 if quick else 9)
        args.compile_reps = args.compile_reps or (1 if quick else 3)
        args.perf_microbatches = args.perf_microbatches or (8 if quick else 16)
    else:
        args.model = args.model or ("tiny-gpt" if quick else "gpt")
        args.microbatches = args.microbatches or ((4, 16) if quick else (8, 32, 128))
        args.schedules = args.schedules or DEFAULT_SCHEDULES
        args.reps = args.reps or (3 if quick else 7)
    if args.suite == "memory" and args.ranks < 8 and not args.quick:
        args.ranks = 8  # the memory suite compiles for 4 and 8 devices
    if args.ranks < 2:
        raise SystemExit("--ranks must be at least 2")
    return args


def pick_devices(count: int) -> tuple[list, str]:
    """`count` devices of the default backend, or fake CPU ones; and a description."""
    devices = jax.devices()
    backend = devices[0].platform
    if backend != "cpu" and len(devices) >= count:
        return devices[:count], f"{count} {devices[0].device_kind} devices ({backend})"
    cpus = jax.devices("cpu")
    if len(cpus) < count:
        raise SystemExit(
            f"need {count} devices but have {len(cpus)} CPU devices: start through "
            "`python -m bench`, which fakes them, or set jax_num_cpu_devices first"
        )
    note = f"{count} fake CPU devices on a {os.cpu_count()}-core host"
    if backend != "cpu":
        note += f" (the {len(devices)} {backend} device(s) are fewer than {count})"
    return cpus[:count], note


def meta(args: argparse.Namespace, devices_note: str, workload) -> dict:
    return {
        "command": "python -m bench " + shlex.join(sys.argv[1:]),
        "suite": args.suite,
        "quick": args.quick,
        "workload": {
            "name": workload.name,
            "description": workload.description,
            "layers": workload.num_layers,
            "microbatch_size": workload.microbatch_size,
        },
        "ranks": args.ranks,
        "chunks": args.chunks,
        "devices": devices_note,
        "host": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "jax": jax.__version__,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "reps": args.reps,
        "large_reps": args.large_reps,
    }


def predictions(row: rows.Row, costs: dict) -> dict:
    """The predicted step on real devices, from measured per-stage costs.

    A jpipe row gets the simulator's makespan, its total work and the
    lock-step plan's time. The peer is lock-step by construction: every
    stage runs every iteration, so its step is ``iterations * (max F + max
    B)`` over its stages (priced with jpipe's per-stage costs for the same
    cut, so the embedding and head, which the peer runs outside the loop,
    are counted inside it).
    """
    if row.kind == "peer":
        per_iteration = max(costs["F"]) + max(costs["B"])
        return {"predicted_lockstep_seconds": row.info["iterations"] * per_iteration}
    sched = row.pipeline.schedule
    c = jpipe.Costs(
        F=tuple(costs["F"]), I=tuple(costs["I"]), W=tuple(costs["W"]), B=tuple(costs["B"])
    )
    sim = jpipe.simulate(sched, c)
    out = {
        "predicted_overlap_seconds": sim.makespan,
        "work_seconds": float(sum(sim.busy)),
        "bubble_fraction": sim.bubble_fraction,
        "predicted_lockstep_seconds": None,
    }
    predicted = getattr(row.pipeline.tick_plan, "predicted_time", None)
    if predicted is not None:
        out["predicted_lockstep_seconds"] = float(predicted(c))
    return out


def build_group(workload, M: int, devices, args) -> list:
    """The group's rows, as builders (so one failing row does not stop the rest)."""
    R = len(devices)
    builders = [(rows.ONE_DEVICE, lambda: rows.baseline_rows(workload, M, devices))]
    if not args.no_peer:
        builders.append((rows.PEER_GPIPE, lambda: [rows.peer_row(workload, M, devices, 1)]))
        if M >= R and args.chunks > 1:
            builders.append(
                ("peer circular", lambda: [rows.peer_row(workload, M, devices, args.chunks)])
            )
    for name in args.schedules:
        builders.append(
            (
                f"jpipe {name}",
                lambda name=name: [rows.jpipe_row(workload, name, M, devices, args.chunks)],
            )
        )
    return builders


def profile_programs(workload, stage_counts, device, log) -> dict:
    """The profiler's compiled pieces for each stage count: ``{S: [Compiled, ...]}``."""
    microbatch = workload.batch(1)
    out = {}
    for S in stage_counts:
        try:
            fns, params = workload.stages(S)
        except ValueError as e:
            log(f"  no profile for {S} stages: {e}")
            continue
        out[S] = profile.stage_programs(fns, params, microbatch, device, S)
    return out


def time_with_profile(programs, pieces: dict, reps: int) -> tuple[dict, dict]:
    """Times rows and profiler pieces together: ``(times by name, costs by stage count)``."""
    everything = list(programs) + [p for ps in pieces.values() for p in ps]
    times = measure.time_together(everything, reps)
    costs = {S: profile.costs_from_times(times, S, S) for S in pieces}
    return times, costs


def run_group(workload, M: int, devices, args, pieces: dict, log) -> tuple[list[dict], dict]:
    """Compiles, checks and times one group; returns its report rows and profiled costs."""
    records, programs, by_name, predicted_rows = [], [], {}, {}
    for label, build in build_group(workload, M, devices, args):
        try:
            built = build()
        except Exception as e:  # a schedule may refuse these numbers
            records.append({"microbatches": M, "name": label, "kind": "?", "error": _error(e)})
            log(f"  M={M} {label}: not built: {_error(e)}")
            continue
        for row in built:
            rec = {"microbatches": M, "name": row.name, "kind": row.kind, **row.info}
            records.append(rec)
            try:
                prog = measure.compile_program(row.name, row.lowerable, row.args)
                loss = float(jax.block_until_ready(prog.fn(*prog.args))[0])
            except Exception as e:
                rec["error"] = _error(e)
                log(f"  M={M} {row.name}: failed: {_error(e)}")
                if os.environ.get("BENCH_DEBUG"):
                    traceback.print_exc()
                continue
            rec.update(
                compile_seconds=prog.compile_seconds,
                temp_bytes=prog.temp_bytes,
                argument_bytes=prog.argument_bytes,
                output_bytes=prog.output_bytes,
                loss=loss,
            )
            programs.append(prog)
            by_name[row.name] = rec
            if row.kind in ("jpipe", "peer"):
                predicted_rows[row.name] = row
            log(
                f"  M={M} {row.name}: compiled in {prog.compile_seconds:.2f}s, temp "
                f"{report.mib(prog.temp_bytes)} MiB/device, loss {loss:.6f}"
            )
    reps = args.reps if M < 64 else min(args.reps, args.large_reps)
    times, costs = time_with_profile(programs, pieces, reps)
    for prog in programs:
        ts = times[prog.name]
        by_name[prog.name].update(
            step_seconds=measure.median(ts), step_min_seconds=float(min(ts)), times=list(ts)
        )
    for name, row in predicted_rows.items():
        if row.info["stages"] in costs:
            by_name[name].update(predictions(row, costs[row.info["stages"]]))
    compare(records)
    for rec in records:
        if rec.get("step_seconds") is not None:
            log(
                f"  M={M} {rec['name']}: {rec['step_seconds'] * 1e3:.1f} ms "
                f"({rec['vs_one_device']:.2f}x one device)"
            )
    return records, costs


def ratio(times: list[float], base: list[float]) -> float:
    """The median over rounds of ``times[i] / base[i]``.

    Rows are timed in interleaved rounds, so the i-th time of every row was
    taken within seconds of the others: a ratio per round cancels the slow
    and fast spells of a shared machine better than a ratio of medians.
    """
    if len(times) == len(base) and times:
        return measure.median([t / b for t, b in zip(times, base)])
    return measure.median(times) / measure.median(base)


def compare(records: list[dict]) -> None:
    """Adds each row's ratios to one device, data parallelism and the peer, and its loss error."""
    by_name = {r["name"]: r for r in records}

    def times(name):
        return by_name.get(name, {}).get("times")

    bases = {
        "vs_one_device": times(rows.ONE_DEVICE),
        "vs_data_parallel": times(rows.DATA_PARALLEL),
        "vs_peer": times(rows.PEER_GPIPE),
    }
    ref_loss = by_name.get(rows.ONE_DEVICE, {}).get("loss")
    for rec in records:
        if rec.get("times"):
            for key, base in bases.items():
                rec[key] = ratio(rec["times"], base) if base else None
                # Best against best: the runs least disturbed by other load.
                rec["best_" + key] = min(rec["times"]) / min(base) if base else None
        if ref_loss is not None and rec.get("loss") is not None:
            rec["loss_rel_err"] = abs(rec["loss"] - ref_loss) / max(abs(ref_loss), 1e-30)


def _error(e: Exception) -> str:
    text = f"{type(e).__name__}: {e}"
    return text.splitlines()[0][:300]


def stage_counts(args) -> list[int]:
    return sorted(
        {args.ranks} | {args.ranks * rows.chunks_for(s, args.chunks) for s in args.schedules}
    )


def run_table(args: argparse.Namespace, log=print) -> dict:
    devices, note = pick_devices(args.ranks)
    workload = get_workload(args.model)
    log(f"bench: {workload.description}; {note}")
    result = {"meta": meta(args, note, workload), "profile": {}, "rows": []}
    pieces = profile_programs(workload, stage_counts(args), devices[0], log)
    for M in args.microbatches:
        records, costs = run_group(workload, M, devices, args, pieces, log)
        result["rows"].extend(records)
        result["profile"][str(M)] = {str(S): c for S, c in costs.items()}
    return result
