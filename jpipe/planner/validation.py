"""Validation: jpipe's predictions against plans measured on real clusters.

`validate_directory` reads every Sailor ``plan_config_*.json`` under a folder,
predicts each with `jpipe.planner.plans.evaluate` (the schedule simulated) and with
the closed form on the same inputs, and returns one `Row` per plan with the
measured seconds per iteration and peak memory. Memory is predicted under the
``mpmd`` layout (Sailor's runtime ran one program per rank), and also
where the profile has the model's bytes but no times for the device
(`memory_footprint` needs no times). Plans whose model has no usable profile
are kept as rows with the reason, not dropped silently.

The data's known flaws (`flaws`) are handled in the open: a plan file that
lists a layer twice and omits one in its place is read with the omitted layer
(a note says so); a plan whose measured memory is below what its own runtime
must hold (its parameters' state plus one microbatch of residuals on its
busiest device), or more than 20% below a twin with the same per-GPU setup
(model, stage layers, device types, T, B and live microbatches), is left out
of the memory medians with the reason beside it.

`markdown` writes the report in docs/planner-validation.md: the table per
cluster, the median absolute errors, an ablation of the two global modelling
choices, and, per cluster setup (same folder, so same devices), which plan
jpipe and the closed form would pick against the measured fastest.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import statistics

from jpipe.planner.plans import GIB, ClusterPlan, evaluate, load_sailor_plan, memory_footprint
from jpipe.planner.profiles import SAILOR_DIR, Profile, load_sailor_profile, monotone_in_batch

# Sailor's folder names for models, as its profiles name them.
_MODEL_ALIASES = {"OPT-350": "OPT-350", "GPT-NEO": "GPT-Neo-2.7", "LLAMA": "LLAMA-3-8"}


@dataclasses.dataclass(frozen=True)
class Row:
    """One measured plan and its predictions (seconds per iteration, bytes)."""

    path: str
    cluster: str
    setup: str
    model: str
    measured_seconds: float
    measured_mem: float
    global_batch: int
    predicted_seconds: float | None = None
    closed_form_seconds: float | None = None
    predicted_mem: float | None = None
    shape: str = ""
    note: str = ""
    mem_note: str = ""
    excluded: str = ""  # why the plan is left out of the memory medians
    twin_key: tuple = dataclasses.field(default=(), compare=False, repr=False)
    min_need: float | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def mem_error(self) -> float | None:
        if self.predicted_mem is None:
            return None
        return self.predicted_mem / self.measured_mem - 1

    @property
    def error(self) -> float | None:
        if self.predicted_seconds is None:
            return None
        return self.predicted_seconds / self.measured_seconds - 1

    @property
    def closed_form_error(self) -> float | None:
        if self.closed_form_seconds is None:
            return None
        return self.closed_form_seconds / self.measured_seconds - 1


def model_of(path: str, num_layers: int, profiles_dir: str) -> str:
    """The Sailor model a plan file is for: from its path, else from its layer count."""
    for part in reversed(os.path.normpath(path).split(os.sep)):
        for key, model in _MODEL_ALIASES.items():
            if part.upper().startswith(key.upper()):
                return model
    with open(os.path.join(profiles_dir, "llm_info.json")) as f:
        info = json.load(f)
    matches = [m for m, by_b in info.items() if len(next(iter(by_b.values()))) == num_layers]
    if len(matches) != 1:
        raise ValueError(
            f"cannot tell the model of {path} ({num_layers} layers matches {matches or 'none'}); "
            "give --model"
        )
    return matches[0]


def repair_layers(plan: ClusterPlan, num_layers: int) -> tuple[ClusterPlan, str]:
    """Reads a stage list that names one layer twice and omits one in its place.

    Sailor's GPT-Neo plan files list ``[16, 17, 18, 29, 20, ...]``: layer 29
    twice, 19 never. Where exactly one layer is missing, exactly one is
    listed twice, and putting the missing one at one of the duplicate's places
    makes the stages hold every layer in order, that is the reading, with a
    note; anything else is left as it is (and `ClusterPlan.check` refuses it).
    """
    flat = [l for st in plan.stage_layers for l in st]
    missing = sorted(set(range(num_layers)) - set(flat))
    twice = sorted({l for l in flat if flat.count(l) > 1})
    if len(missing) != 1 or len(twice) != 1 or len(flat) != num_layers:
        return plan, ""
    for at in (i for i, l in enumerate(flat) if l == twice[0]):
        fixed = flat[:at] + missing + flat[at + 1 :]
        if fixed == list(range(num_layers)):
            stages, k = [], 0
            for st in plan.stage_layers:
                stages.append(tuple(fixed[k : k + len(st)]))
                k += len(st)
            note = (
                f"the file lists layer {twice[0]} twice and never {missing[0]}; "
                f"read as {missing[0]}"
            )
            return dataclasses.replace(plan, stage_layers=tuple(stages)), note
    return plan, ""


def validate_directory(
    directory: str,
    profiles_dir: str | None = None,
    *,
    clean: bool = True,
    receiver_busy: bool = True,
    schedule: str = "1f1b",
    working_factor: float | None = None,
    memory_terms: dict | None = None,
    repair_links: bool = True,
    element_scale: float = 1.0,
) -> list[Row]:
    """Predicts every plan file under `directory` (see the module docstring).

    For the ablations: `working_factor` and `memory_terms` (``{term: value}``),
    if given, replace the profiles' own terms; `repair_links` `False` keeps the
    links the data copies from another pair of nodes as published;
    `element_scale` scales every residual and transfer byte (0.5: fp16).
    """
    profiles_dir = profiles_dir or SAILOR_DIR
    paths = sorted(glob.glob(os.path.join(directory, "**", "plan_config_*.json"), recursive=True))
    if not paths:
        raise ValueError(f"no plan_config_*.json files under {directory}")
    cache: dict[str, Profile | str] = {}
    rows = []
    for path in paths:
        rel = os.path.relpath(path, directory)
        parts = rel.split(os.sep)
        cluster = parts[0] if len(parts) > 1 else ""
        setup = os.path.dirname(rel)
        plan, raw = load_sailor_plan(path, schedule)
        num_layers = sum(len(s) for s in plan.stage_layers)
        model = model_of(rel, num_layers, profiles_dir)
        base = dict(
            path=rel,
            cluster=cluster,
            setup=setup,
            model=model,
            measured_seconds=float(raw["real"]),
            measured_mem=float(raw["max_mem"]),
            global_batch=plan.global_batch,
        )
        if model not in cache:
            try:
                profile = load_sailor_profile(model, profiles_dir, repair_links=repair_links)
                if element_scale != 1.0:
                    profile = _scale_elements(profile, element_scale)
                cache[model] = monotone_in_batch(profile) if clean else profile
            except ValueError as e:
                cache[model] = str(e)
        profile = cache[model]
        shape = (
            f"pp={plan.pipe} dp={plan.data} tp={plan.tensor_parallel} B={plan.microbatch_size} "
            f"M={plan.num_microbatches} "
            + "/".join(sorted({d.kind for r in plan.ranks for d in r}))
        )
        if isinstance(profile, str):
            rows.append(Row(**base, shape=shape, note=profile))
            continue
        if working_factor is not None or memory_terms:
            change = dict(memory_terms or {})
            if working_factor is not None:
                change["working_factor"] = working_factor
            terms = dataclasses.replace(profile.memory_terms, **change)
            profile = dataclasses.replace(profile, memory_terms=terms, derived=set(), _links={})
        plan, repaired = repair_layers(plan, profile.num_layers)
        links = _repaired_links(plan, profile)
        repaired = "; ".join(x for x in (repaired, links) if x)
        mem, mem_note, min_need = None, repaired, None
        try:
            footprint = memory_footprint(plan, profile)
            mem = footprint.max_bytes("mpmd")
            min_need = max(
                m.parts["parameters"] + m.parts["values"] / max(_live(plan, m.rank), 1)
                for m in footprint.devices("mpmd")
            )
        except ValueError as e:
            mem_note = str(e)
        twin = (
            model,
            plan.stage_layers,
            tuple(tuple((d.kind, d.tensor_parallel) for d in r[:1]) for r in plan.ranks),
            plan.microbatch_size,
            min(plan.num_microbatches, plan.pipe),
        )
        extra = dict(
            shape=shape, predicted_mem=mem, mem_note=mem_note, twin_key=twin, min_need=min_need
        )
        try:
            ev = evaluate(plan, profile, receiver_busy=receiver_busy)
        except ValueError as e:
            rows.append(Row(**base, note=str(e), **extra))
            continue
        rows.append(
            Row(
                **base,
                predicted_seconds=ev.step_seconds,
                closed_form_seconds=ev.closed_form_seconds,
                note=repaired,
                **extra,
            )
        )
    return flaws(rows)


def _scale_elements(profile: Profile, scale: float) -> Profile:
    """`profile` with every residual and transfer byte times `scale`."""
    return dataclasses.replace(
        profile,
        activation_bytes={
            t: tuple(x * scale for x in v) for t, v in profile.activation_bytes.items()
        },
        output_bytes=tuple(x * scale for x in profile.output_bytes),
        derived=set(),
        _links={},
    )


def _repaired_links(plan: ClusterPlan, profile: Profile) -> str:
    """The profile's notes on links it read from another entry, for those `plan` crosses."""
    notes = getattr(profile, "link_notes", {})
    used = []
    for s in range(plan.pipe - 1):
        for d in range(plan.data):
            a, b = plan.ranks[s][d], plan.ranks[s + 1][d]
            key = (a.kind, a.gpus_per_node, b.kind, b.gpus_per_node)
            if a.node != b.node and key in notes and notes[key] not in used:
                used.append(notes[key])
    return "; ".join(used)


def _live(plan: ClusterPlan, rank: int) -> int:
    """1F1B's most live microbatches on `rank` (Sailor's runtime ran 1F1B)."""
    return min(plan.pipe - rank, plan.num_microbatches)


def flaws(rows: list[Row]) -> list[Row]:
    """The rows with `Row.excluded` set where the measured memory cannot be trusted.

    Two rules, each applied to every plan: the measurement is below the state
    of its parameters plus one microbatch of residuals on its busiest device
    (under the profile's own runtime terms, without the overhead), which no
    run of that plan can hold less than; or it is more than 20% below a twin
    (same model, stage layers, device types and T, B, and 1F1B live
    microbatches) measured in the same data.
    """
    out = []
    for r in rows:
        why = ""
        if r.min_need is not None and r.measured_mem < r.min_need:
            why = (
                f"measures {r.measured_mem / GIB:.1f} GiB, below its parameters' state plus "
                f"one microbatch of residuals ({r.min_need / GIB:.1f} GiB)"
            )
        else:
            twins = [t for t in rows if t.twin_key == r.twin_key and t is not r and r.twin_key]
            high = max(twins, key=lambda t: t.measured_mem, default=None)
            if high is not None and r.measured_mem < 0.8 * high.measured_mem:
                why = (
                    f"measures {(1 - r.measured_mem / high.measured_mem) * 100:.0f}% below "
                    f"{os.path.basename(high.path)} ({high.measured_mem / GIB:.1f} GiB), a twin "
                    "with the same per-GPU setup"
                )
        out.append(dataclasses.replace(r, excluded=why) if why else r)
    return out


def medians(rows: list[Row], cluster: str) -> tuple[float, float, int]:
    """(jpipe's, closed form's) median absolute time error on `cluster`, and the plan count."""
    done = [r for r in rows if r.cluster == cluster and r.error is not None]
    if not done:
        return float("nan"), float("nan"), 0
    return (
        statistics.median(abs(r.error) for r in done),
        statistics.median(abs(r.closed_form_error) for r in done),
        len(done),
    )


def memory_medians(rows: list[Row], cluster: str) -> tuple[float, int, float, int]:
    """Median absolute memory error on `cluster`: (over the plans not excluded, their
    count, over every predicted plan, its count)."""
    done = [r for r in rows if r.cluster == cluster and r.mem_error is not None]
    kept = [r for r in done if not r.excluded]
    med = lambda rs: statistics.median(abs(r.mem_error) for r in rs) if rs else float("nan")  # noqa: E731
    return med(kept), len(kept), med(done), len(done)


def picks(rows: list[Row]) -> list[dict]:
    """Per setup and global batch with several predicted plans (the same devices and the
    same work, so seconds per iteration compare): the measured fastest, jpipe's pick and
    the closed form's."""
    out = []
    for setup, batch in sorted({(r.setup, r.global_batch) for r in rows}):
        group = [
            r for r in rows if (r.setup, r.global_batch) == (setup, batch) and r.error is not None
        ]
        if len(group) < 2:
            continue
        fastest = min(group, key=lambda r: r.measured_seconds)
        ours = min(group, key=lambda r: r.predicted_seconds)
        closed = min(group, key=lambda r: r.closed_form_seconds)
        out.append(
            {
                "setup": setup,
                "global_batch": batch,
                "plans": len(group),
                "fastest": fastest,
                "jpipe": ours,
                "closed_form": closed,
                "jpipe_regret": ours.measured_seconds / fastest.measured_seconds - 1,
                "closed_form_regret": closed.measured_seconds / fastest.measured_seconds - 1,
            }
        )
    return out


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:+.1f}%"


def markdown(
    rows: list[Row],
    ablation: dict[str, list[Row]] | None = None,
    working: dict[float, list[Row]] | None = None,
    transfers: tuple[list[Row], list[Row]] | None = None,
) -> str:
    """The validation report (tables, medians, ablations of the time and memory
    choices, picks)."""
    lines = []
    for cluster in sorted({r.cluster for r in rows}):
        lines += [
            f"### {cluster}",
            "",
            "| plan | shape | measured s | jpipe s | error | closed form s | error "
            "| measured GiB | jpipe GiB | error |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in (r for r in rows if r.cluster == cluster):
            mem = (
                "- | -"
                if r.predicted_mem is None
                else f"{r.predicted_mem / GIB:.1f} | {_pct(r.mem_error)}"
                + (" (left out)" if r.excluded else "")
            )
            if r.error is None:
                lines.append(
                    f"| {r.path} | {r.shape} | {r.measured_seconds:.4g} | - | - | - | - "
                    f"| {r.measured_mem / GIB:.1f} | {mem} |"
                )
                continue
            lines.append(
                f"| {r.path} | {r.shape} | {r.measured_seconds:.4g} | {r.predicted_seconds:.4g} "
                f"| {_pct(r.error)} | {r.closed_form_seconds:.4g} | {_pct(r.closed_form_error)} "
                f"| {r.measured_mem / GIB:.1f} | {mem} |"
            )
        ours, closed, n = medians(rows, cluster)
        kept, n_kept, every, n_every = memory_medians(rows, cluster)
        lines += [
            "",
            f"Median absolute time error on {cluster} ({n} plans predicted): "
            f"jpipe {ours * 100:.1f}%, closed form {closed * 100:.1f}%.",
            "",
            f"Median absolute memory error on {cluster}: {kept * 100:.1f}% over the {n_kept} "
            f"plans not left out ({every * 100:.1f}% over all {n_every} predicted).",
            "",
        ]
        notes = [r for r in rows if r.cluster == cluster and (r.note or r.mem_note or r.excluded)]
        if notes:
            lines.append("Notes, left out and not predicted:")
            lines.append("")
            for r in notes:
                said = []
                if r.error is None:
                    said.append(f"time not predicted: {r.note}")
                elif r.note:
                    said.append(r.note)
                if r.predicted_mem is None:
                    said.append(f"memory not predicted: {r.mem_note}")
                elif r.mem_note and r.mem_note != r.note:
                    said.append(r.mem_note)
                if r.excluded:
                    said.append(f"left out of the memory median: {r.excluded}")
                lines.append(f"- {r.path}: " + "; ".join(dict.fromkeys(said)))
            lines.append("")
    if ablation:
        clusters = sorted({r.cluster for r in rows})
        lines += [
            "### The time model's choices, switched",
            "",
            "| variant | " + " | ".join(f"{c} jpipe | {c} closed form" for c in clusters) + " |",
            "|---|" + "---:|---:|" * len(clusters),
        ]
        for name, variant in ablation.items():
            cells = []
            for c in clusters:
                ours, closed, _ = medians(variant, c)
                cells.append(f"{ours * 100:.1f}% | {closed * 100:.1f}%")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    if transfers:
        busy, sender = transfers
        lines += [
            "### Transfers: both GPUs busy or the sender only, per plan that sends",
            "",
            "| plan | shape | both busy | sender only |",
            "|---|---|---:|---:|",
        ]
        sends = [
            (a, b)
            for a, b in zip(busy, sender)
            if a.error is not None and not a.shape.startswith("pp=1 ")
        ]
        for a, b in sends:
            lines.append(f"| {a.path} | {a.shape} | {_pct(a.error)} | {_pct(b.error)} |")
        lines.append("")
        for c in sorted({a.cluster for a, _ in sends}):
            pairs = [(a, b) for a, b in sends if a.cluster == c]
            med = lambda rs: statistics.median(abs(r.error) for r in rs)  # noqa: E731
            lines.append(
                f"Median absolute time error over the {len(pairs)} {c} plans that send: both "
                f"busy {med([a for a, _ in pairs]) * 100:.1f}%, sender only "
                f"{med([b for _, b in pairs]) * 100:.1f}%."
            )
            lines.append("")
    if working:
        clusters = sorted({r.cluster for r in rows})
        lines += [
            "### The memory model's choices, switched",
            "",
            "Median absolute memory error over the plans not left out (over all predicted "
            "in brackets).",
            "",
            "| variant | " + " | ".join(clusters) + " |",
            "|---|" + "---:|" * len(clusters),
        ]
        for factor, variant in working.items():
            cells = []
            for c in clusters:
                kept, _, every, _ = memory_medians(variant, c)
                cells.append(f"{kept * 100:.1f}% ({every * 100:.1f}%)")
            name = f"working factor {factor:g}" if isinstance(factor, int | float) else factor
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    chosen = picks(rows)
    if chosen:
        lines += [
            "### Which plan each would choose",
            "",
            "Plans that ran on the same nodes with the same global batch, so their seconds per "
            "iteration compare. *Its measured cost* is how much slower, measured, the picked "
            "plan ran than the fastest.",
            "",
            "| setup | global batch | plans | measured fastest | jpipe picks | its measured cost "
            "| closed form picks | its measured cost |",
            "|---|---:|---:|---|---|---:|---|---:|",
        ]
        for p in chosen:
            name = lambda r: os.path.basename(r.path).removeprefix("plan_config_")  # noqa: E731
            lines.append(
                f"| {p['setup']} | {p['global_batch']} | {p['plans']} | {name(p['fastest'])} "
                f"({p['fastest'].measured_seconds:.4g} s) | {name(p['jpipe'])} "
                f"| {_pct(p['jpipe_regret'])} | {name(p['closed_form'])} "
                f"| {_pct(p['closed_form_regret'])} |"
            )
        lines.append("")
    return "\n".join(lines)
