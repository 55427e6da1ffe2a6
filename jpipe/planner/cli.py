"""Plan for mixed devices: split layers, choose meshes and schedules by simulating them.

Usage::

    python -m jpipe.plan --model OPT-350 --devices A100-40:4,V100-16:4 --global-batch 256
        [--schedules 1f1b,zb_h1,my.py:fn] [--microbatch-sizes 1,2,4] [--top 3]
        [--profiles DIR_OR_FILE] [--raw-profiles] [--save plan.json] [--svg FILE] [--json]
        [--memory-layout spmd|mpmd] [--tensor-per-stage]
        [--attention auto|xla|blockwise|cudnn] [--remat auto|none|dots|attention|full]
    python -m jpipe.plan --layer-costs 3,1,4,1,5 --speeds 1,1,0.5 [--json]
    python -m jpipe.plan --validate PLAN_CONFIG.json [--profiles DIR] [--model M] [--json]
    python -m jpipe.plan --validate-all DIR [--profiles DIR] [--markdown | --json]

Planning (``--model``) searches tensor-, data- and pipeline-parallel degrees,
device orderings, microbatch sizes and schedules; each candidate's layers are
split by the exact partitioner and its schedule simulated with the profile's
per-stage costs, transfers, all-reduce and update (`jpipe.planner.plans`).
``--schedules search`` has `jpipe.search_schedule` choose, for each shape,
the fastest built-in (with its options, V shapes, and memory actions where
the layout's lowering runs them) whose footprint fits the tightest device.
``--tensor-per-stage`` (with ``--memory-layout mpmd``) gives each device
type its own tensor degree, so stages may differ in it (`plan`'s
``tensor_per_stage``; the plan file's ``mesh.tensor_per_rank``). It
prints the best plans with their predicted step time, per-device peak memory
and why each was chosen, and a chart of the winner; ``--save`` writes the
winner as a plan file that the trainer reads (`read_plan_file`).

``--layer-costs`` splits layers over devices of the given relative speeds
(a stage's time is its layers' sum over its speed) and prints the optimal
``partition`` and ``bottleneck`` with the uniform and speed-proportional
baselines.

``--validate`` simulates a Sailor plan file as given (its stages, layers,
devices, data- and tensor-parallel degrees, microbatch size and global batch)
and prints ``predicted_seconds`` per iteration and
``predicted_max_mem_bytes``, with the closed form and, when the file has them,
the measured figures. ``--validate-all`` does every plan under a folder and
``--markdown`` writes the report in docs/planner-validation.md.

Profiles default to the published Sailor ones inside jpipe; ``--profiles``
takes another Sailor data folder or a jpipe profile JSON file. Sailor times
are made non-decreasing in microbatch size unless ``--raw-profiles``.
``--attention`` and ``--remat`` say how the model computes attention and what
each block keeps for its backward (`jpipe.planner.choices` derives the
profile's bytes and times under them); ``auto``, the default, tries the
profile as measured first, then the choices that hold less, and the plan
says which it uses. Bad input exits with status 2 and one line ``error:
...`` naming the flag; with ``--json`` also one JSON object ``{"error": ...}``
on stdout, which, where no plan fits for memory, names the binding device,
the bytes it needs and has, and the profile's sequence length.
The printed text gives memory in GiB (2^30 bytes; an A100-40 holds 40 GiB);
``--json`` and plan files give bytes. ``--memory`` takes bytes and refuses a
figure no device has (``cpu:8`` for 8 GiB, say).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from jpipe.lower.interface import MPMD
from jpipe.planner.choices import ATTENTION, AUTO, REMAT, choices_to_try, with_choice
from jpipe.planner.partition import (
    partition,
    proportional_partition,
    speed_costs,
    uniform_partition,
)
from jpipe.planner.plans import (
    LAYOUTS,
    MEMORY_MARGIN,
    NoPlanFits,
    describe_shape,
    evaluate,
    gib,
    load_sailor_plan,
    memory_footprint,
    parse_devices,
    plan,
    plan_file,
)
from jpipe.planner.profiles import (
    SAILOR_DIR,
    check_plausible,
    load_profile,
    load_sailor_profile,
    monotone_in_batch,
)
from jpipe.planner.validation import (
    markdown,
    medians,
    memory_medians,
    model_of,
    repair_layers,
    validate_directory,
)
from jpipe.schedule.chart import draw_gantt, text_chart
from jpipe.search.engine import PER_RANK_FASTER, layout_kind


class _Usage(ValueError):
    """A bad command line; the message names the flag."""


def _numbers(text: str, flag: str, kind=float) -> list:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise _Usage(f"{flag} expects comma-separated numbers, got {text!r}") from None
    if not values:
        raise _Usage(f"{flag} is empty")
    return values


def _parser(cls: type[argparse.ArgumentParser] = argparse.ArgumentParser):
    p = cls(
        prog="python -m jpipe.plan",
        description="Plan pipeline parallelism on mixed devices by simulating the schedule.",
    )
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--model", help="plan this model (a profile name such as OPT-350)")
    mode.add_argument("--layer-costs", metavar="C1,C2,...", help="split these layer costs")
    mode.add_argument("--validate", metavar="PLAN_CONFIG.json", help="predict a Sailor plan")
    mode.add_argument("--validate-all", metavar="DIR", help="predict every Sailor plan under DIR")
    p.add_argument("--devices", metavar="TYPE:N,...", help="devices to plan for")
    p.add_argument("--global-batch", type=int, help="sequences per step")
    p.add_argument(
        "--schedules",
        default="1f1b",
        help="schedule SPECs to try, comma-separated; 'search' has jpipe.search_schedule pick "
        "the fastest built-in that fits each shape",
    )
    p.add_argument("--microbatch-sizes", metavar="B1,B2", help="microbatch sizes to try")
    p.add_argument("--top", type=int, default=3, help="how many plans to print")
    p.add_argument(
        "--tensor-parallel",
        metavar="T1,T2",
        help="tensor-parallel degrees to try (default 1,2,4,8 where they fit)",
    )
    p.add_argument(
        "--tensor-per-stage",
        action="store_true",
        help="give each device type its own tensor-parallel degree (from --tensor-parallel), "
        "so stages may differ in degree; needs --memory-layout mpmd (lowering='mpmd', "
        "one mesh per rank)",
    )
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs of one type per node")
    p.add_argument("--speeds", metavar="S1,S2,...", help="relative device speed of each stage")
    p.add_argument("--profiles", metavar="DIR|FILE", help="Sailor data folder or jpipe profile")
    p.add_argument("--raw-profiles", action="store_true", help="use Sailor times as published")
    p.add_argument(
        "--sender-only",
        action="store_true",
        help="a transfer occupies the sending GPU only (default: both GPUs)",
    )
    p.add_argument(
        "--memory-layout",
        choices=LAYOUTS,
        default="spmd",
        help="memory check: spmd (jpipe's one program, every device holds the largest rank's "
        "need; the default) or mpmd (each device its own rank's)",
    )
    p.add_argument(
        "--memory-margin",
        type=float,
        default=MEMORY_MARGIN,
        help="share of every device's usable memory kept free (default %(default)s)",
    )
    p.add_argument(
        "--memory",
        metavar="TYPE:BYTES,...",
        help="each device type's memory, where the profile lacks it or to override it "
        "(e.g. cpu:8e9)",
    )
    p.add_argument(
        "--attention",
        default="auto",
        choices=("auto", *ATTENTION),
        help="the model's attention: xla (scores materialized, as Sailor profiled), "
        "blockwise or cudnn (flash-style, no L x L scores); auto (the default) tries xla, "
        "then blockwise where nothing fits",
    )
    p.add_argument(
        "--remat",
        default="auto",
        choices=("auto", *REMAT),
        help="the model's per-block rematerialization: none, dots, attention or full; auto "
        "(the default) tries none, then dots, then full where nothing fits",
    )
    p.add_argument("--schedule", default="1f1b", help="schedule a validated plan ran")
    p.add_argument("--save", metavar="FILE", help="write the best plan as a plan file")
    p.add_argument("--svg", metavar="FILE", help="draw the best plan's schedule to FILE")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--markdown", action="store_true", help="--validate-all: a markdown report")
    return p


def _load(args, model: str):
    source = args.profiles
    if source and os.path.isfile(source):
        profile = load_profile(source)
        if profile.model != model:
            raise _Usage(f"--profiles {source} is for model {profile.model!r}, not {model!r}")
    elif source and not os.path.isdir(source):
        raise _Usage(f"--profiles {source!r} is neither a folder nor a file")
    else:
        profile = load_sailor_profile(model, source or SAILOR_DIR)
        profile = profile if args.raw_profiles else monotone_in_batch(profile)
    if args.memory:
        memory = dict(profile.memory)
        for item in filter(None, (x.strip() for x in args.memory.split(","))):
            kind, _, value = item.rpartition(":")
            try:
                nbytes = float(value)
            except ValueError:
                nbytes = 0.0
            if not kind or not nbytes > 0:
                raise _Usage(f"--memory: cannot read {item!r}; expected TYPE:BYTES like cpu:8e9")
            try:
                memory[kind] = check_plausible(nbytes, "device_bytes", f"{kind}'s memory")
            except ValueError as e:
                raise _Usage(f"--memory: {e}") from None
        profile = dataclasses.replace(profile, memory=memory, derived=set(), _links={})
    return profile


def _layer_costs(args) -> dict:
    costs = _numbers(args.layer_costs, "--layer-costs")
    speeds = _numbers(args.speeds, "--speeds") if args.speeds else [1.0]
    if any(c < 0 for c in costs):
        raise _Usage("--layer-costs must be non-negative")
    if any(s <= 0 for s in speeds):
        raise _Usage("--speeds must be positive")
    if len(speeds) > len(costs):
        raise _Usage(
            f"--speeds gives {len(speeds)} stages but --layer-costs only {len(costs)} layers"
        )
    rows = speed_costs(costs, speeds)
    best = partition(rows)
    return {
        **best.to_json(),
        "speeds": speeds,
        "uniform": uniform_partition(rows).to_json(),
        "proportional": proportional_partition(rows).to_json(),
    }


def _validate(args) -> dict:
    path = args.validate
    if not os.path.isfile(path):
        raise _Usage(f"--validate {path!r}: no such file")
    plan_, raw = load_sailor_plan(path, args.schedule)
    num_layers = sum(len(s) for s in plan_.stage_layers)
    model = args.model or model_of(path, num_layers, args.profiles or SAILOR_DIR)
    profile = _load(args, model)
    if (args.attention, args.remat) != (AUTO, AUTO):  # as measured unless asked
        shape = profile.shape
        measured = (shape.attention, shape.remat) if shape is not None else ("xla", "none")
        attention = measured[0] if args.attention == AUTO else args.attention
        remat = measured[1] if args.remat == AUTO else args.remat
        profile = with_choice(profile, choices_to_try(profile, attention, remat)[0])
    plan_, repaired = repair_layers(plan_, profile.num_layers)
    try:
        ev = evaluate(plan_, profile, receiver_busy=not args.sender_only)
    except ValueError as e:  # no times for its devices: the memory needs none
        memory = memory_footprint(plan_, profile)  # refuses a plan it cannot read
        out = {
            "model": model,
            **plan_.to_json(),
            "time_not_predicted": str(e),
            "predicted_max_mem_bytes": memory.max_bytes(plan_.memory_layout),
            "devices": [m.to_json() for m in memory.devices(plan_.memory_layout)],
        }
        ev = None
    else:
        out = {"model": model, **ev.summary(args.memory_margin)}
    if repaired:
        out["note"] = repaired
    if "real" in raw:
        out["measured_seconds"] = raw["real"]
        if ev is not None:
            out["error"] = ev.step_seconds / raw["real"] - 1
            out["closed_form_error"] = ev.closed_form_seconds / raw["real"] - 1
    if "max_mem" in raw:
        out["measured_max_mem_bytes"] = raw["max_mem"]
        out["mem_error"] = out["predicted_max_mem_bytes"] / raw["max_mem"] - 1
    return out


def _plan(args) -> tuple[dict, str]:
    if not args.devices:
        raise _Usage("--model needs --devices TYPE:N[,TYPE:N...]")
    if not args.global_batch or args.global_batch < 1:
        raise _Usage("--model needs --global-batch N (a positive whole number)")
    if args.top < 1:
        raise _Usage("--top must be at least 1")
    try:
        devices = parse_devices(args.devices)
    except ValueError as e:
        raise _Usage(f"--devices: {e}") from None
    profile = _load(args, args.model)
    sizes = (
        _numbers(args.microbatch_sizes, "--microbatch-sizes", int)
        if args.microbatch_sizes
        else None
    )
    schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    options = dict(
        schedules=schedules,
        microbatch_sizes=sizes,
        gpus_per_node=args.gpus_per_node,
        top=args.top,
        receiver_busy=not args.sender_only,
        memory_layout=args.memory_layout,
        memory_margin=args.memory_margin,
        tensor_parallel=_numbers(args.tensor_parallel, "--tensor-parallel", int)
        if args.tensor_parallel
        else None,
        tensor_per_stage=args.tensor_per_stage,
        attention=args.attention,
        remat=args.remat,
    )
    result = plan(profile, devices, args.global_batch, **options)
    best = result.best[0].evaluation
    advice = _per_rank_faster(profile, devices, args.global_batch, options, result)
    profile = result.profile or profile  # its bytes and times under the chosen options
    if args.save:
        with open(args.save, "w") as f:
            json.dump(plan_file(best, profile), f, indent=1)
    if args.svg:
        draw_gantt(best.simulation, args.svg)
    out = {
        "model": profile.model,
        "devices": dict(devices),
        "global_batch": args.global_batch,
        "memory_terms": profile.memory_terms.to_json(),
        "plans": [
            {**c.evaluation.summary(args.memory_margin), "why": list(c.reasons)}
            for c in result.best
        ],
        "candidates": result.considered,
        "simulated": result.simulated,
        "skipped": len(result.skipped),
        "unsplit": result.unsplit,
        "seconds": result.seconds,
        "derived_profile_entries": sorted(map(list, profile.derived)),
    }
    choice = _choice_line(profile, result)
    if choice:
        out["model_options"] = result.memory_choice.to_json()
        out["model_options_tried"] = [c.to_json() for c in result.tried]
    unsplit = f", {result.unsplit} shapes left unsplit (bound)" if result.unsplit else ""
    text = [
        f"{profile.model} on {args.devices}, global batch {args.global_batch}: "
        f"{result.considered} candidates, {result.simulated} simulated, "
        f"{len(result.skipped)} skipped{unsplit}, {result.seconds:.2f} s; "
        "memory in GiB (2^30 bytes)",
        *([choice] if choice else []),
        *([advice[0]] if advice else []),
        "",
    ]
    if advice:
        out["per_rank_plan"] = advice[1]
    for i, c in enumerate(result.best):
        ev = c.evaluation
        text.append(
            f"#{i + 1}  {ev.step_seconds:.4g} s/step, {gib(ev.max_peak_bytes)} on the "
            f"fullest device ({ev.plan.memory_layout} layout)"
        )
        text += [f"    {line}" for line in c.reasons]
        text.append(f"    layers per stage: {[list(s) for s in ev.plan.stage_layers]}")
        text.append("")
    text.append("chart of the best plan's slowest replica (time in seconds):")
    text.append(text_chart(best.simulation, width=100))
    if profile.derived:
        text.append(f"profile entries derived (not measured): {sorted(profile.derived)}")
    return out, "\n".join(text)


def _per_rank_faster(profile, devices, global_batch, options, result):
    """Under the SPMD layout, whether the per-rank lowering's layout fits a faster plan
    (the one program holds the largest rank's terms on every device, which can keep
    the fastest shapes out): ``(line, JSON)``, or None."""
    if not layout_kind(options["memory_layout"]).every_device_holds_busiest:
        return None
    try:
        other = plan(
            profile, devices, global_batch, **(options | {"memory_layout": MPMD.layout, "top": 1})
        )
    except NoPlanFits:
        return None
    ev, best = other.best[0].evaluation, result.best[0].evaluation
    if ev.step_seconds >= best.step_seconds * (1 - PER_RANK_FASTER):
        return None
    faster = best.step_seconds / ev.step_seconds - 1
    choice = other.memory_choice
    options_differ = choice is not None and choice != result.memory_choice
    line = (
        f"the per-rank lowering (--memory-layout mpmd, lowering='mpmd', each rank on a mesh "
        f"of its own) fits a plan "
        f"{faster:.1%} faster: {describe_shape(ev.plan)}, {ev.step_seconds:.4g} s/step, "
        f"{gib(ev.max_peak_bytes)} on its fullest device"
        + (f", with {choice}" if options_differ else "")
        + " (the one SPMD program holds the largest rank's terms on every device)"
    )
    return line, {
        "shape": describe_shape(ev.plan),
        "memory_layout": MPMD.layout,
        "step_seconds": ev.step_seconds,
        "peak_bytes": ev.max_peak_bytes,
        **(choice.to_json() if choice is not None else {}),
    }


def _choice_line(profile, result) -> str:
    """Which attention and remat the plans assume, and why, or "" where the profile
    does not give its model's shape."""
    choice = result.memory_choice
    if choice is None:
        return ""
    shape = profile.shape
    seq = f"sequences of {shape.sequence_length} tokens" if shape else "its sequences"
    measured = shape is not None and (choice.attention, choice.remat) == (
        shape.attention,
        shape.remat,
    )
    line = f"model options: {choice} (set them in the model's config)"
    if result.tried:
        line += "; nothing fits with " + ", nor with ".join(str(c) for c in result.tried)
    if measured:
        return f"{line}; the profile's bytes as measured ({seq})"
    return f"{line}; bytes and times derived from the profile's ({seq}) by a model, not measured"


class _JsonErrors(argparse.ArgumentParser):
    """A parser whose errors are raised (as `_Usage`) rather than printed, so that
    ``--json`` can answer them in JSON."""

    def error(self, message):
        raise _Usage(message)


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit status (0, or 2 on an error).

    Every error is one line ``error: ...`` on stderr. With ``--json`` it is also one
    JSON object on stdout, ``{"error": ...}``, a bad command line's included; where no
    plan fits for memory the object also names the binding device, the bytes it needs
    and has, and the profile's sequence length (`NoPlanFits.to_json`).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    as_json = "--json" in argv
    try:
        args = _parser(_JsonErrors if as_json else argparse.ArgumentParser).parse_args(argv)
    except _Usage as e:
        print(json.dumps({"error": f"{e}", "usage": _parser().format_usage().strip()}))
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    try:
        if args.layer_costs:
            out = _layer_costs(args)
            text = (
                f"partition  {out['partition']}\nbottleneck {out['bottleneck']:g}\n"
                f"stage times {out['stage_times']}\n"
                f"uniform split bottleneck {out['uniform']['bottleneck']:g}, "
                f"speed-proportional {out['proportional']['bottleneck']:g}"
            )
        elif args.validate:
            out = _validate(args)
            text = "\n".join(f"{k}: {v}" for k, v in out.items())
        elif args.validate_all:
            if not os.path.isdir(args.validate_all):
                raise _Usage(f"--validate-all {args.validate_all!r}: no such folder")
            rows = validate_directory(
                args.validate_all,
                args.profiles,
                clean=not args.raw_profiles,
                receiver_busy=not args.sender_only,
                schedule=args.schedule,
            )
            ablation = working = None
            if args.markdown:
                ablation = {
                    f"clean={c}, receiver busy={b}": validate_directory(
                        args.validate_all,
                        args.profiles,
                        clean=c,
                        receiver_busy=b,
                        schedule=args.schedule,
                    )
                    for c in (True, False)
                    for b in (True, False)
                }
                again = lambda **kw: validate_directory(  # noqa: E731
                    args.validate_all, args.profiles, schedule=args.schedule, **kw
                )
                ablation["links as published (Titan-RTX<->RTX-2080 at 1 and 8 GPUs copied)"] = (
                    again(repair_links=False)
                )
                ablation["2-byte (fp16) transfers"] = again(element_scale=0.5)
                sailor_sim = {"overhead_bytes": 5.06e9, "single_gpu_overhead_bytes": None}
                working = {
                    "as chosen (fp32, working factor 0, overhead by device)": rows,
                    **{f: again(working_factor=f) for f in (0.5, 1.0, 2.0)},
                    "4.71 GiB overhead on every device (Sailor's simulator's 5.06e9 bytes)": again(
                        memory_terms=sailor_sim
                    ),
                    "2-byte (fp16) residuals": again(element_scale=0.5),
                    "2-byte (fp16) residuals, working factor 1, 4.71 GiB everywhere (the last "
                    "release)": again(
                        element_scale=0.5, working_factor=1.0, memory_terms=sailor_sim
                    ),
                }
            out = {
                "plans": [
                    {k: v for k, v in r.__dict__.items() if k not in ("twin_key", "min_need")}
                    | {"error": r.error, "mem_error": r.mem_error}
                    for r in rows
                ],
                "memory_medians": {
                    c: dict(
                        zip(("kept", "kept_plans", "all", "all_plans"), memory_medians(rows, c))
                    )
                    for c in sorted({r.cluster for r in rows})
                },
                "time_medians": {
                    c: dict(zip(("jpipe", "closed_form", "plans"), medians(rows, c)))
                    for c in sorted({r.cluster for r in rows})
                },
            }
            transfers = None
            if ablation:
                transfers = (ablation["clean=True, receiver busy=True"],
                             ablation["clean=True, receiver busy=False"])  # fmt: skip
            text = markdown(rows, ablation, working, transfers)
        else:
            out, text = _plan(args)
    except (ValueError, OSError) as e:
        if args.json:
            print(json.dumps(e.to_json() if isinstance(e, NoPlanFits) else {"error": str(e)}))
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out))
    else:
        print(text)
    return 0
