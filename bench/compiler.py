"""The compiler's figures: memory, compile time and where step time goes.

Two measurements on the compiler issue's shape (``dense``: 4 ranks, stages of
two dense layers of width 1024, microbatches of 64 rows, float32):

1. Memory and compile time against the microbatch count: every schedule (and
   the peer) compiled at each M, fresh each time (tracing included), the
   median of ``--compile-reps`` compiles, with the compiled per-device temp
   bytes. 1F1B should stay flat, GPipe should grow.
2. Performance at one M: the one-device step, data parallelism, the peer,
   every jpipe schedule and three diagnostics (`bench.baselines.lockstep`:
   every device runs one stage's pieces with no pipeline, without barriers,
   with a barrier per piece in phase, and rotated as in a pipeline), timed
   together. For each jpipe row the same program
   is also compiled with an all-idle table (every rank idle at every tick:
   the loop, the branch selection, the slot bookkeeping and the collectives
   still run, no stage does). Its time divided by the ticks sizes the
   per-tick overhead. The one-device step that runs the microbatches one
   after another (``one device, microbatched``) sizes the useful work at the
   microbatch's granularity; what is left after both is waiting at the
   lock-step collectives and contention for the shared cores.

The memory table also shows, for jpipe, the temp bytes of the same step fed
a batch already cut into microbatches (a diagnostic through a private hook
of `jpipe.Pipeline`): the difference is the copy the step makes when it cuts
the batch itself.

Interleaved and V schedules cut the same 8 layers into 8 stages of one dense
layer each, so every row runs the same model.
"""

from __future__ import annotations

import sys

import jax

from bench import measure, rows
from bench.run import compare, predictions, profile_programs, stage_counts, time_with_profile
from bench.run import ratio as run_ratio
from bench.workloads import get_workload


def memory_rows(workload, devices, args, log) -> list[dict]:
    out = []
    names = list(args.schedules) + ([] if args.no_peer else [rows.PEER_GPIPE])
    # One throw-away compile first, so that JAX's own first-use costs do not
    # land on the first point of the table.
    warm = rows.jpipe_row(workload, names[0], args.microbatches[0], devices, args.chunks)
    measure.compile_program("warm-up", warm.lowerable, warm.args)
    for M in args.microbatches:
        for name in names:
            rec = {"microbatches": M, "name": name if name == rows.PEER_GPIPE else f"jpipe {name}"}
            seconds, temp = [], None
            try:
                for _ in range(args.compile_reps):
                    if name == rows.PEER_GPIPE:
                        row = rows.peer_row(workload, M, devices, 1)
                    else:
                        row = rows.jpipe_row(workload, name, M, devices, args.chunks)
                    prog = measure.compile_program(row.name, row.lowerable, row.args)
                    seconds.append(prog.compile_seconds)
                    temp = prog.temp_bytes
                    del prog
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
                out.append(rec)
                log(f"  M={M} {name}: {rec['error']}")
                continue
            rec.update(
                row.info,
                compile_seconds=measure.median(seconds),
                compile_all=seconds,
                temp_bytes=temp,
            )
            if row.pipeline is not None:
                rec["presplit_temp_bytes"] = presplit_temp(row, M)
            out.append(rec)
            log(
                f"  M={M} {rec['name']}: compile {rec['compile_seconds']:.2f}s, "
                f"temp {rec['temp_bytes']} bytes"
            )
    return out


def presplit_temp(row: rows.Row, num_microbatches: int) -> int | None:
    """Temp bytes of a jpipe step whose batch arrives already cut into microbatches.

    Uses the SPMD lowering's `_build` (`jpipe.lower.spmd.lowering`), which returns the step
    on ``[M, rows, ...]`` inputs; None if that hook is gone or the step does
    not compile that way, saying why on stderr (a diagnostic column: the suite
    goes on without it).
    """
    pipe = row.pipeline
    packed, batch = row.args
    build = getattr(getattr(pipe, "_lowering", None), "_build", None)
    if build is None:
        return None
    try:
        _, step = build(batch)
        M = num_microbatches
        cut = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct((M, a.shape[0] // M) + a.shape[1:], a.dtype), batch
        )
        shardings = jax.tree.map(lambda a: a.sharding, batch)
        lowered = jax.jit(step, in_shardings=(pipe.param_sharding, shardings)).lower(packed, cut)
        return int(lowered.compile().memory_analysis().temp_size_in_bytes)
    except Exception as e:  # a diagnostic column: say why it is empty, go on
        print(
            f"bench compiler: pre-split temp of {row.name} left out: {type(e).__name__}: {e}",
            file=sys.stderr,
        )
        return None


def performance(workload, devices, args, pieces, log) -> tuple[dict, dict]:
    M = args.perf_microbatches
    built = rows.baseline_rows(workload, M, devices)
    if not args.no_peer:
        built.append(rows.peer_row(workload, M, devices, 1))
        if M >= len(devices):
            built.append(rows.peer_row(workload, M, devices, args.chunks))
    built += [rows.jpipe_row(workload, name, M, devices, args.chunks) for name in args.schedules]
    if workload.num_layers % max(3, len(devices)) == 0:
        built += rows.lockstep_rows(workload, M, devices)
    records, programs, predicted_rows = [], [], {}
    for row in built:
        rec = {"microbatches": M, "name": row.name, "kind": row.kind, **row.info}
        records.append(rec)
        try:
            prog = measure.compile_program(row.name, row.lowerable, row.args)
            out = jax.block_until_ready(prog.fn(*prog.args))
            if row.kind != "diagnostic":  # the diagnostics return gradients only
                rec["loss"] = float(out[0])
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
            continue
        rec.update(
            compile_seconds=prog.compile_seconds,
            temp_bytes=prog.temp_bytes,
            argument_bytes=prog.argument_bytes,
        )
        if row.kind in ("jpipe", "peer"):
            predicted_rows[row.name] = row
        programs.append(prog)
        log(f"  {row.name}: compiled in {prog.compile_seconds:.2f}s")
    idle_names = {}
    for name in args.schedules:
        row = rows.jpipe_row(workload, name, M, devices, args.chunks, all_idle=True)
        prog = measure.compile_program(row.name + " (all idle)", row.lowerable, row.args)
        programs.append(prog)
        idle_names[row.name] = prog.name
    times, costs = time_with_profile(programs, pieces, args.reps)
    step = {p.name: measure.median(times[p.name]) for p in programs}
    for rec in records:
        if rec["name"] in step:
            ts = times[rec["name"]]
            rec.update(step_seconds=step[rec["name"]], step_min_seconds=min(ts), times=ts)
        row = predicted_rows.get(rec["name"])
        if row is not None and row.info["stages"] in costs:
            rec.update(predictions(row, costs[row.info["stages"]]))
    compare(records)
    for rec in records:
        if "step_seconds" in rec:
            log(
                f"  {rec['name']}: {rec['step_seconds'] * 1e3:.1f} ms "
                f"({rec['vs_one_device']:.2f}x one device)"
            )
    overhead = []
    mb_times = times.get(rows.ONE_DEVICE_MICROBATCHED)
    for rec in records:
        idle_name = idle_names.get(rec["name"])
        if idle_name is None or "step_seconds" not in rec:
            continue
        idle_times, step_times = times[idle_name], rec["times"]
        entry = {
            "name": rec["name"],
            "ticks": rec["ticks"],
            "step_seconds": rec["step_seconds"],
            "idle_seconds": measure.median(idle_times),
            "idle_times": idle_times,
            "per_tick_seconds": measure.median(idle_times) / rec["ticks"],
            "work_seconds": rec.get("work_seconds"),
        }
        if mb_times:
            # Per round, like the ratios: what is left once the microbatched
            # work on one device and the all-idle program are taken away.
            entry["microbatched_seconds"] = measure.median(mb_times)
            entry["vs_microbatched"] = run_ratio(step_times, mb_times)
            entry["rest_seconds"] = measure.median(
                [t - i - m for t, i, m in zip(step_times, idle_times, mb_times)]
            )
        overhead.append(entry)
    return {"microbatches": M, "rows": records, "overhead": overhead}, costs


def run(args, devices_picker, meta, log=print) -> dict:
    devices, note = devices_picker(args.ranks)
    workload = get_workload(args.model)
    log(f"bench compiler suite: {workload.description}; {note}")
    result = {"meta": meta(args, note, workload), "profile": {}, "memory": [], "performance": {}}
    log("memory and compile time against microbatches")
    result["memory"] = memory_rows(workload, devices, args, log)
    pieces = profile_programs(workload, stage_counts(args), devices[0], log)
    log(f"performance at M={args.perf_microbatches}")
    result["performance"], costs = performance(workload, devices, args, pieces, log)
    result["profile"] = {str(args.perf_microbatches): {str(S): c for S, c in costs.items()}}
    return result
