"""Find the fastest schedule that fits a memory budget per device, and say why it won.

Usage::

    python -m jpipe.search --profile gpt2_small --ranks 4 --microbatches 16 --budget 9GiB
    python -m jpipe.search --profile WORKDIR/profile.json --ranks 4 --microbatches 8 --budget 2MiB
        [--device NAME] [--rate partner_bytes_per_s=2e11,host_bytes_per_s=2.5e10] [...]
        [--layout spmd|mpmd] [--schedules 1f1b,zb_h1,vmin,...] [--no-local]
        [--batch N] [--rate flops_per_second=4e14,...] [--margin 0.1] [--max-simulations 20000]
        [--json] [--png FILE] [--svg FILE] [--csv FILE] [--width 120]
    python -m jpipe.search --cost F=1,I=1,W=1,evict=0.3 \\
        --bytes activation=1e9,carry=5e8,params=2e9,input=6e6,working=1.5e9 \\
        --ranks 4 --microbatches 16 --budget 6e9

The figures are each stage's costs and bytes for one microbatch: a
profile (``--profile``): the one ``train.py --config.profile=True`` writes
(``WORKDIR/profile.json``, ``jpipe-profile/2``: measured stages, from which
per-layer figures form every split, so schedules with V stages per rank
compete), a ``jpipe-stages/1`` file (figures per split), or ``gpt2_small``,
the one shipped with jpipe, made from GPT-2 small's shapes by ``python -m
bench.stage_profile``; a profile is read strictly, and a number in the
wrong unit (GiB for bytes, TFLOP/s for FLOP/s) is refused naming the file
and the field. Or ``--cost`` and ``--bytes`` (one value for all
stages, standing for one rank's share at one stage per rank, or one per
stage separated by ``/``, as in ``F=1/1/1/2``; ``working`` is the largest
piece's working memory, ``grad_output`` the gradients an SPMD step returns
beside its accumulator; bytes may carry a unit, ``1.5GiB``).

See `jpipe.search.engine` for what is searched and how memory is
counted: per device, the parameters (``params``: weights, gradients,
optimizer state), the live residuals, carries and kept inputs, and the
working memory of the largest piece; under ``--layout spmd`` (the SPMD
lowering, the default) each the largest rank's, the residual and carry
buffers as that program sizes them; under ``mpmd``
(``lowering="mpmd"``) each rank's own. ``--margin`` (default 0.1) keeps a
share of the budget free for what the model does not count. Memory actions
(recompute, evict,
offload) are searched only where that lowering runs them.

It prints the winner and why it won (its step, its bytes against the
budget, term by term, what faster candidates needed and the next that fits),
the best built-in that fits, a chart of the winner, and the fastest
candidates. ``--csv`` saves the winner in PyTorch's CSV form (``train.py
--config.schedule=FILE.csv`` runs it; a winner with memory actions needs
``--config.lowering=mpmd`` today), ``--png``/``--svg`` draw it, ``--json``
prints one JSON object instead. Bytes print in the unit that suits them
(B, KiB, MiB, GiB, TiB); candidates whose simulated steps tie are listed
with the fewest memory actions first, and the winner is the first that
fits (`jpipe.search.engine.rank_candidates`). Bad input exits with status 2 and one line
``error: ...``; no schedule that fits exits with status 1.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
import warnings

from jpipe.lower.interface import MPMD
from jpipe.schedule.chart import draw_gantt, text_chart
from jpipe.schedule.simulate import Costs, Sizes
from jpipe.search.engine import (
    LAYOUTS,
    MARGIN,
    PER_RANK_FASTER,
    StageFigures,
    byte_unit,
    format_bytes,
    layout_kind,
    load_stage_profile,
    search_schedule,
)

__all__ = ["main", "parse_bytes"]

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}  # fmt: skip


def parse_bytes(text: str, *, positive: bool = True) -> float:
    """``"9GiB"``, ``"12.5GB"``, ``"8e9"`` as a number of bytes (positive, unless not
    `positive`)."""
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-z]*)\s*", text)
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS:
        raise ValueError(
            f"cannot read {text!r} as bytes: expected a number with an optional unit "
            "(B, KiB, MiB, GiB, TiB, KB, MB, GB, TB), such as 9GiB or 8e9"
        )
    try:
        value = float(match.group(1)) * _UNITS[unit]
    except ValueError:
        raise ValueError(
            f"cannot read {text!r} as bytes: {match.group(1)!r} is no number"
        ) from None
    if positive and not value > 0:
        raise ValueError(f"a budget must be positive, got {text!r}")
    return value


def _items(text: str, keys: tuple[str, ...], flag: str, units: bool = False) -> dict:
    """``K=V,K=V`` with V a number or ``a/b/c`` (one per stage); with `units`, bytes
    such as ``1.5GiB``."""
    read = (lambda v: parse_bytes(v, positive=False)) if units else float
    out = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in keys:
            raise ValueError(f"{flag}: cannot read {item!r}; expected KEY=VALUE with KEY one of "
                             f"{', '.join(keys)}")  # fmt: skip
        try:
            parts = [read(v) for v in value.split("/")]
        except ValueError:
            raise ValueError(f"{flag}: {key}={value!r} is not a number or numbers a/b/c") from None
        out[key] = parts[0] if len(parts) == 1 else tuple(parts)
    return out


def figures_from_flags(cost: str, nbytes: str) -> StageFigures:
    """`StageFigures` from ``--cost`` and ``--bytes``."""
    costs = _items(cost, Costs._KEYS, "--cost")
    sizes = _items(nbytes, Sizes._KEYS + ("working", "grad_output"), "--bytes", units=True)
    working = sizes.pop("working", 0.0)
    grads = sizes.pop("grad_output", 0.0)
    lengths = {
        len(v) for v in (*costs.values(), *sizes.values(), working, grads) if isinstance(v, tuple)
    }
    if isinstance(costs.get("comm"), tuple):
        lengths.discard(len(costs["comm"]))
    if len(lengths) > 1:
        raise ValueError(f"--cost and --bytes give per-stage lists of {sorted(lengths)} values")
    S = lengths.pop() if lengths else None
    if isinstance(costs.get("comm"), tuple) and S is None:
        S = len(costs["comm"]) + 1
    return StageFigures(
        Costs(**costs),
        Sizes(**sizes),
        working=working,
        grad_output=grads,
        num_stages=S,
        source="--cost/--bytes",
    )


def _rates(text: str | None) -> dict | None:
    if not text:
        return None
    out = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise ValueError(f"--rate: cannot read {item!r}; expected NAME=NUMBER")
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jpipe.search",
        description="Find the fastest schedule whose simulated bytes per device fit a budget.",
    )
    p.add_argument(
        "--profile",
        metavar="FILE|NAME",
        help="a profile: what train.py --config.profile=True writes "
        "(WORKDIR/profile.json, jpipe-profile/2), a jpipe-stages/1 file, or gpt2_small",
    )
    p.add_argument("--device", help="the device type to read from a jpipe-profile/2 that has "
                   "several")  # fmt: skip
    p.add_argument("--cost", default=None, metavar="F=1,I=1,W=1,...", help="costs per stage")
    p.add_argument("--bytes", default=None, metavar="activation=...,working=...",
                   help="bytes per stage: activation, carry, params, input, working")  # fmt: skip
    p.add_argument("-r", "--ranks", type=int, required=True, help="pipeline ranks R")
    p.add_argument("-m", "--microbatches", required=True, metavar="M[,M...]",
                   help="microbatch counts to try")  # fmt: skip
    p.add_argument("--budget", required=True, help="bytes per device, such as 9GiB or 8e9")
    p.add_argument("--layout", choices=LAYOUTS, default="spmd",
                   help="spmd: every device holds the largest rank's terms (the SPMD lowering, "
                   "default); mpmd: each its own (lowering='mpmd')")  # fmt: skip
    p.add_argument("--schedules", help="SPECs to try, comma-separated (default: every built-in); "
                   "SPEC@V for V chunks")  # fmt: skip
    p.add_argument("--no-local", action="store_true", help="no local search over memory actions")
    p.add_argument(
        "--batch",
        type=int,
        help="sequences per step: each M gets figures scaled to batch/M sequences",
    )
    p.add_argument("--rate", help="a profile's rates to override, NAME=NUMBER,... "
                   "(jpipe-stages/1: flops_per_second, partner_bytes_per_s, host_bytes_per_s; "
                   "jpipe-profile/2: the two bandwidths)")  # fmt: skip
    p.add_argument("--margin", type=float, default=MARGIN,
                   help="share of the budget kept free (default %(default)s)")  # fmt: skip
    p.add_argument(
        "--max-simulations",
        type=int,
        default=20_000,
        help="bound on the schedules the local search simulates (default %(default)s)",
    )
    p.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="a bound on the local search's time too (then load-dependent)",
    )
    p.add_argument("--top", type=int, default=8, help="candidates to list")
    p.add_argument("--width", type=int, default=120, help="chart width in columns")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--png", metavar="FILE", help="draw the winner to FILE")
    p.add_argument("--svg", metavar="FILE", help="draw the winner to FILE")
    p.add_argument("--csv", metavar="FILE", help="save the winner as PyTorch CSV to FILE")
    return p


def _schedules(text: str | None):
    if not text:
        return None
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        spec, at, chunks = item.rpartition("@")
        if at and chunks.isdigit():
            out.append((spec, int(chunks)))
        else:
            out.append(item)
    return out


def _run(args):
    if (args.profile is None) == (args.cost is None and args.bytes is None):
        raise ValueError("give the figures either as --profile or as --cost and --bytes")
    if args.profile is not None:
        with warnings.catch_warnings():  # printed below, one line each
            warnings.simplefilter("ignore")
            figures = load_stage_profile(args.profile, _rates(args.rate), device=args.device)
        for line in figures.warnings:
            print(f"warning: {line}", file=sys.stderr)
    else:
        if args.device:
            raise ValueError("--device picks a device type of a --profile")
        if args.rate:
            raise ValueError("--rate applies to a --profile's rates; --cost gives times directly")
        figures = figures_from_flags(args.cost or "", args.bytes or "")
    try:
        Ms = [int(x) for x in args.microbatches.split(",") if x.strip()]
    except ValueError:
        raise ValueError(
            f"--microbatches expects whole numbers, got {args.microbatches!r}"
        ) from None
    if len(Ms) > 1 and args.batch is None and not hasattr(figures, "microbatch_size"):
        raise ValueError(
            "several --microbatches compare steps of different batches unless --batch says "
            "how many sequences a step has"
        )
    for path, ext in ((args.svg, ".svg"), (args.png, ".png")):
        if path and not path.lower().endswith(ext):
            raise ValueError(f"--{ext[1:]} needs a file name ending in {ext}, got {path!r}")
    batch = args.batch
    if batch is None and len(Ms) > 1:
        batch = Ms[0] * figures.microbatch_size
    log = (lambda line: print(line, file=sys.stderr)) if not args.json else None

    def search(layout, local, log, max_seconds):
        return search_schedule(
            figures,
            args.ranks,
            Ms,
            parse_bytes(args.budget),
            layout=layout,
            schedules=_schedules(args.schedules),
            local=local,
            batch=batch,
            margin=args.margin,
            max_simulations=args.max_simulations,
            max_seconds=max_seconds,
            log=log,
        )

    result = search(args.layout, not args.no_local, log, args.max_seconds)
    per_rank = None
    left = None if args.max_seconds is None else args.max_seconds - result.seconds
    if left is None or left > 0:  # --max-seconds bounds both searches together
        per_rank_log = None if log is None else (lambda line: log(f"per-rank layout: {line}"))
        again = functools.partial(search, log=per_rank_log, max_seconds=left)
        per_rank = _per_rank_instead(result, again, not args.no_local)
    return result, figures, per_rank


def _per_rank_instead(result, search, local: bool):
    """Under the SPMD layout, the per-rank lowering's best where it is what fits, or
    faster (every device of the one program holds the largest rank's terms): the
    mpmd search over the same schedules, its built-ins alone where the SPMD layout
    fitted something (a bound: the local search could only add to it), or None."""
    if not layout_kind(result.layout).every_device_holds_busiest:
        return None
    other = search(MPMD.layout, local and result.winner is None).winner
    if other is None:
        return None
    if result.winner is not None and other.time >= result.winner.time * (1 - PER_RANK_FASTER):
        return None
    return other


def _table(result, top: int) -> list[str]:
    shown = result.candidates[:top]
    unit = byte_unit(max((c.memory.most for c in shown), default=0.0))
    size = lambda x: format_bytes(x, unit).split()[0]  # noqa: E731  (one unit a column)
    lines = [f"{'candidate':<52} {'step':>10} {unit[0]:>8} {'memory actions':>15}  fits"]
    for c in shown:
        lines.append(f"{c.label[:52]:<52} {c.time:>10.4g} {size(c.memory.most):>8} "
                     f"{c.memory_actions:>15}  {'yes' if c.fits else 'no'}")  # fmt: skip
    return lines


def _winner_bytes(w) -> list[str]:
    m = w.memory
    unit = byte_unit(m.most)
    size = lambda x: format_bytes(x, unit).split()[0]  # noqa: E731  (one unit for the table)
    lines = [f"rank  stages      params    values   working    device ({unit[0]})"]
    for r in range(len(m.device)):
        stages = ",".join(map(str, w.schedule.stages_of(r))) or "-"
        lines.append(
            f"{r:>4}  {stages:<8}{size(m.params[r]):>10}{size(m.values[r]):>10}"
            f"{size(m.working[r]):>10}{size(m.device[r]):>11}"
        )
    if layout_kind(m.layout).every_device_holds_busiest:
        lines.append(
            "(spmd: every device holds the largest params, the buffers as the program sizes "
            "them and the largest working memory; see the parts above)"
        )
    return lines


def _per_rank_line(result, per_rank) -> str:
    """One line naming the per-rank lowering's best (`_per_rank_instead`), or ""."""
    if per_rank is None:
        return ""
    what = (
        "fits where nothing fits the one program"
        if result.winner is None
        else f"is {result.winner.time / per_rank.time - 1:.1%} faster"
    )
    return (
        f"under the per-rank lowering (--layout mpmd, lowering='mpmd': each device its own "
        f"rank's values and working memory) {per_rank.label} {what}: step {per_rank.time:.4g}, "
        f"{format_bytes(per_rank.memory.most)} on its fullest device"
    )


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit status (0; 1 if nothing fits; 2 on an error)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    try:
        result, figures, per_rank = _run(args)
        w = result.winner
        written = []
        if w is not None:
            if args.csv:
                w.schedule.to_csv(args.csv)
                written.append(args.csv)
            for path in (args.png, args.svg):
                if path:
                    draw_gantt(w.simulation, path)
                    written.append(path)
    except (ValueError, TypeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    advice = _per_rank_line(result, per_rank)
    if args.json:
        print(json.dumps({"figures": getattr(figures, "model", figures.source),
                          "warnings": list(getattr(figures, "warnings", ())),
                          **result.to_json(),
                          **({"per_rank": per_rank.to_json()} if per_rank else {})}))  # fmt: skip
    else:
        print(
            f"{result.simulated} schedules simulated in {result.seconds:.1f} s; budget "
            f"{format_bytes(result.budget)} per device, {result.layout} layout; memory actions "
            f"the {result.lowering} lowering runs: {', '.join(result.memory_moves) or 'none'}"
        )
        print()
        print("\n".join(result.reasons()))
        if w is not None:
            print()
            print(text_chart(w.simulation, width=args.width))
            print()
            print("\n".join(_winner_bytes(w)))
        print()
        print("\n".join(_table(result, args.top)))
        if result.skipped:
            print(f"\n{len(result.skipped)} not simulated or not searched (--json lists why)")
        if advice:
            print(f"\n{advice}")
    for path in written:
        print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
    return 0 if w is not None else 1
