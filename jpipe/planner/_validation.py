"""Validation: jpipe's predictions against plans measured on real clusters.

`validate_directory` reads every Sailor ``plan_config_*.json`` under a folder,
predicts each with `jpipe.planner._search.evaluate` (the schedule simulated) and with
the closed form on the same inputs, and returns one `Row` per plan with the
measured seconds per iteration and peak memory. Plans whose model has no
usable profile are kept as rows with the reason, not dropped silently.

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

from jpipe.planner._profiles import SAILOR_DIR, Profile, load_sailor_profile, monotone_in_batch
from jpipe.planner._search import evaluate, load_sailor_plan

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


def validate_directory(
    directory: str,
    profiles_dir: str | None = None,
    *,
    clean: bool = True,
    receiver_busy: bool = True,
    schedule: str = "1f1b",
) -> list[Row]:
    """Predicts every plan file under `directory` (see the module docstring)."""
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
                profile = load_sailor_profile(model, profiles_dir)
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
        try:
            ev = evaluate(plan, profile, receiver_busy=receiver_busy)
        except ValueError as e:
            rows.append(Row(**base, shape=shape, note=str(e)))
            continue
        rows.append(
            Row(
                **base,
                predicted_seconds=ev.step_seconds,
                closed_form_seconds=ev.closed_form_seconds,
                predicted_mem=ev.max_peak_bytes,
                shape=shape,
            )
        )
    return rows


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


def markdown(rows: list[Row], ablation: dict[str, list[Row]] | None = None) -> str:
    """The validation report (tables, medians, ablation, picks)."""
    lines = []
    for cluster in sorted({r.cluster for r in rows}):
        lines += [
            f"### {cluster}",
            "",
            "| plan | shape | measured s | jpipe s | error | closed form s | error "
            "| measured GB | jpipe GB |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in (r for r in rows if r.cluster == cluster):
            if r.error is None:
                lines.append(
                    f"| {r.path} | {r.shape} | {r.measured_seconds:.4g} | - | - | - | - "
                    f"| {r.measured_mem / 1e9:.1f} | - |"
                )
                continue
            lines.append(
                f"| {r.path} | {r.shape} | {r.measured_seconds:.4g} | {r.predicted_seconds:.4g} "
                f"| {_pct(r.error)} | {r.closed_form_seconds:.4g} | {_pct(r.closed_form_error)} "
                f"| {r.measured_mem / 1e9:.1f} | {r.predicted_mem / 1e9:.1f} |"
            )
        ours, closed, n = medians(rows, cluster)
        lines += [
            "",
            f"Median absolute time error on {cluster} ({n} plans predicted): "
            f"jpipe {ours * 100:.1f}%, closed form {closed * 100:.1f}%.",
            "",
        ]
        skipped = [r for r in rows if r.cluster == cluster and r.error is None]
        if skipped:
            lines.append("Not predicted:")
            lines.append("")
            for r in skipped:
                lines.append(f"- {r.path}: {r.note}")
            lines.append("")
    if ablation:
        clusters = sorted({r.cluster for r in rows})
        lines += [
            "### The two global modelling choices, switched",
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
