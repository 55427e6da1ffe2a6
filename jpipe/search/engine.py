"""Search: the fastest schedule whose per-device bytes fit a memory budget.

Given each stage's costs and bytes (`StageFigures`; a `StageProfile` that
holds them for several splits of one model, read from ``jpipe-stages/1``; or
a `LayerProfile`, figures per layer that form any split, read from the
``jpipe-profile/2`` that ``train.py --config.profile=True`` writes), the
number of ranks R, one or more microbatch counts M and a budget of bytes
per device, `search_schedule` returns the candidate with the lowest
simulated step time (`jpipe.simulate`'s makespan) whose simulated bytes fit
on every device, with why it won. Steps that tie go to the candidate with
fewer memory actions (`rank_candidates`). Profiles are read strictly
(`load_stage_profile`): a number of the wrong type or sign, or in another
unit than the format's, is refused in one line naming the file and field.

Candidates, all validated by `jpipe.validate` (the simulator validates
first):

1. Every built-in with every option the search knows for it (`BUILTINS`:
   1F1B, GPipe, ZB-H1/H2, interleaved 1F1B with 2 to 4 chunks, the V shapes
   ZB-V, V-Half, V-Min and DualPipeV, and the built-ins with memory actions,
   `1f1b_recompute` for k = 1 .. R - 1, `1f1b_bpipe`, `zb_h1_offload` for
   several gaps), for every M given; or the SPECs the caller names.
2. A local search over memory actions: each built-in without them that is
   faster than the best candidate that fits but does not fit itself gets,
   greedily, a recompute (``FC`` ... ``RECOMPUTE``), an eviction to another
   rank (``EVICT`` ... ``LOAD``) or an offload to the host (``OFFLOAD_*`` ...
   ``RELOAD_*``) for single (stage, microbatch) pairs, or for every
   microbatch of one stage at once. Each step takes the change that removes
   the most of the bytes over the budget (the area of the byte curves above
   it, in bytes x time, then the peaks) per unit of step time it adds, among
   the pairs live on the fullest device at its peak; where none frees
   anything, the least harmful one, its pairs then left alone for a few
   steps (a short tabu walk). It gives up on a base when the peak over the
   budget has not fallen for S + R steps. Once it fits, each change is taken
   back where the schedule still fits without it (removing work never makes
   the simulated step longer) and each change is tried as each other
   change for the same pair (a recompute as a transfer, a slow transfer as
   a recompute), kept where it still fits and the step is shorter.
   Transfers are placed as the built-ins place them: an eviction or
   offload right after the action that made (or last read) the residuals,
   the way back one compute action before the next reader, so that action
   hides it. The number of schedules simulated is bounded (a count, not a
   time, so that the answer does not depend on the machine's load). A set of
   moves the walk meets again is built and simulated once; it counts again
   each time it is met, as when it was simulated anew, so that the bound and
   the count reported are unchanged.

Memory, per rank (`DeviceBytes`): the ``params`` bytes its device holds
(weights, gradients, optimizer state), the most live residuals, carries and
kept inputs it holds at once (the simulator's events in time, what it holds
for a partner included; a copy's destination takes its buffer when the copy
is issued), and the working memory of its largest piece (``working``, the
largest over its stages: a piece runs on top of what is live, and the
head's is the largest of GPT-2's). Per device, under the layout (`LAYOUTS`),
as that layout's lowering allocates them, which its byte model says
(`jpipe.lower.interface.LoweringKind.byte_model`; the one the simulator's
figures and the planner read too):

- ``"spmd"``: one program on every device (`Pipeline(lowering="spmd")`,
  `jpipe.lower.spmd.bytes`): every device allocates the largest rank's
  parameters, the gradients the step returns beside its accumulator, the
  residual and carry buffers as the program sizes them from its tick plan
  (`spmd_buffers`), and the largest piece's working memory; the terms may
  come from different ranks (docs/design.md);
- ``"mpmd"``: one program per rank (`Pipeline(lowering="mpmd")`,
  `jpipe.lower.mpmd.bytes`): each device holds its own rank's values,
  working memory and gradients, and (today, on one mesh) every rank's
  packed weights and optimizer state.

A candidate fits when every device is within the budget less a margin
(`MARGIN`) for what the model does not count (docs/search.md measures it).

Which candidates may have memory actions is the lowering's own answer, not a
switch kept here: each `LoweringKind` declares the kinds it runs
(`LoweringKind.memory_actions`, `lowering_runs`), held by a test to what its
own pass accepts. Today both lowerings run every kind, so both searches
take every candidate; under ``"spmd"`` a candidate's buffers come from its
tick plan with its memory actions (`spmd_buffers`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import os
import time
import types
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from jpipe.lower.bytes import HeldBytes, RankBytes
from jpipe.lower.interface import KINDS, MPMD, LoweringKind
from jpipe.runtime.jsonfile import read_json
from jpipe.schedule.actions import COMPUTE_KINDS, MEMORY_KINDS, Action, Overlap, Schedule
from jpipe.schedule.registry import get_schedule
from jpipe.schedule.simulate import (
    Costs,
    Simulation,
    Sizes,
    _live_events,
    _simulation,
    _timed,
    simulate,
)
from jpipe.schedule.validate import ScheduleError, analyze

LAYOUTS = tuple(kind.layout for kind in KINDS.values())  # ("spmd", "mpmd")
"""The memory layouts: the SPMD lowering's, and the per-rank lowering's (`layout_kind`)."""
OWN = MPMD.layout  # each rank's own bytes, the layout the walk reads
# The share of the budget kept free for what the model does not count: on GPT-2 small the
# SPMD program compiled 2 to 8% above the model, the per-rank lowering below it
# (docs/search.md); the planner keeps the same share (`jpipe.planner.MEMORY_MARGIN`).
MARGIN = 0.10


def layout_kind(layout: str) -> LoweringKind:
    """The lowering whose memory a layout stands for (`jpipe.lower.interface`): ``"spmd"`` is
    the SPMD lowering's, ``"mpmd"`` the per-rank lowering's."""
    for kind in KINDS.values():
        if kind.layout == layout:
            return kind
    hint = " (the per-rank layout is called 'mpmd' now, as its lowering)" * (layout == "per_rank")
    raise ValueError(f"memory layout {layout!r} is not one of {', '.join(LAYOUTS)}{hint}")


STAGE_PROFILE_FORMAT = "jpipe-stages/1"
GIB = 2**30
# Two simulated steps within this share of each other tie (`rank_candidates`).
TIE = 1e-9
_BYTE_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def byte_unit(nbytes: float) -> tuple[str, float]:
    """The unit that suits `nbytes`: the largest of B, KiB, MiB, GiB, TiB it fills once."""
    for name, size in _BYTE_UNITS:
        if abs(nbytes) >= size:
            return name, size
    return "B", 1


def format_bytes(nbytes: float, unit: tuple[str, float] | None = None) -> str:
    """``"8.09 GiB"``, ``"52.30 KiB"``, ``"96 B"``: bytes in the unit that suits them (or
    `unit`, a `byte_unit`, so that a column shares one); the search's text uses no other."""
    name, size = unit or byte_unit(nbytes)
    if name == "B":
        return f"{nbytes:.4g} B"
    return f"{nbytes / size:.2f} {name}"


# The built-ins the search tries, with the options it tries for each: (name, chunks per
# rank, {option: values}); a callable of (R, M) gives values that depend on them.
BUILTINS: tuple[tuple[str, tuple[int, ...], dict], ...] = (
    ("1f1b", (1,), {}),
    ("gpipe", (1,), {}),
    ("eager_1f1b", (1,), {}),
    ("zb_h1", (1,), {}),
    ("zb_h2", (1,), {}),
    ("interleaved_1f1b", (2, 3, 4), {}),
    ("zbv", (2,), {}),
    ("zbv", (2,), {"max_deferred_w": lambda R, M: (0, R)}),  # fewer I-to-W carries
    ("vhalf", (2,), {}),
    ("vmin", (2,), {}),
    ("dualpipev", (2,), {}),
    ("1f1b_recompute", (1,), {"k": lambda R, M: range(1, R)}),
    ("1f1b_bpipe", (1,), {}),
    ("zb_h1_offload", (1,), {"min_gap": lambda R, M: (3, 4, 6, 8)}),
)


# -- the figures: each stage's costs and bytes ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class StageFigures:
    """Each stage's costs and bytes for one microbatch, for one split into stages.

    Attributes:
      costs: time of each kind of action (`jpipe.Costs`, per stage or one
        value for all), the memory actions' included (``recompute``,
        ``evict``/``load``, ``offload``/``reload``).
      sizes: bytes (`jpipe.Sizes`): ``activation`` (residuals kept from F to
        the backward), ``carry`` (I to W), ``input`` (what an FC keeps),
        ``params`` (held the whole step: weights, gradients, optimizer state).
      working: the working memory of the stage's largest piece, on top of
        the live values while it runs.
      grad_output: the stage's gradients as the SPMD step returns them,
        beside the accumulator that ``params`` counts (one more copy of the
        gradients on every device under ``"spmd"``; the per-rank lowering
        accumulates in place).
      working_by_kind: where known, each stage's working memory per kind of
        piece (``{"F": ..., "I": ..., "W": ..., "B": ...}``, one dict per
        stage; `working` for a kind not given). The per-rank lowering's
        model then adds to the values a rank holds when each piece starts
        that piece's own working memory, as the rank's account does, rather
        than its largest piece's to its peak of values (`jpipe.lower.bytes`).
        The SPMD program sizes its working memory once for every piece.
      num_stages: the number of stages these figures are for; `None` when
        every value is one number, which then stands for one rank's share of
        the model at one stage per rank: a schedule with V stages per rank
        gets 1/V of every cost and byte per stage (the latency ``comm``
        excepted).
      source: where the figures come from, for reports.
    """

    costs: Costs = Costs()
    sizes: Sizes = Sizes()
    working: float | tuple[float, ...] = 0.0
    grad_output: float | tuple[float, ...] = 0.0
    num_stages: int | None = None
    source: str = ""
    working_by_kind: tuple[Mapping[str, float], ...] | None = None

    def __post_init__(self):
        if self.working_by_kind is not None:  # read-only views: the figures are frozen
            kinds = tuple(types.MappingProxyType(dict(k)) for k in self.working_by_kind)
            object.__setattr__(self, "working_by_kind", kinds)
            if self.num_stages is None or len(kinds) != self.num_stages:
                raise ValueError(
                    f"working_by_kind has {len(kinds)} entries; give one per stage "
                    f"(num_stages={self.num_stages})"
                )
            for v in (v for k in kinds for v in k.values()):
                if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                    raise ValueError(
                        f"working_by_kind bytes must be finite and non-negative, got {v!r}"
                    )
        for name in ("working", "grad_output"):
            value = getattr(self, name)
            if isinstance(value, list):
                value = tuple(value)
                object.__setattr__(self, name, value)
            for v in value if isinstance(value, tuple) else (value,):
                if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                    raise ValueError(f"{name} bytes must be finite and non-negative, got {v!r}")
        lengths = {
            len(v)
            for obj in (self.costs, self.sizes)
            for v in dataclasses.asdict(obj).values()
            if isinstance(v, tuple)
        } | {len(v) for v in (self.working, self.grad_output) if isinstance(v, tuple)}
        lengths.discard(self.num_stages)
        if isinstance(self.costs.comm, tuple):
            lengths.discard(len(self.costs.comm))  # one per boundary
        if self.num_stages is None and lengths:
            raise ValueError(
                f"figures with one value per stage need num_stages (got lists of "
                f"{sorted(lengths)} values)"
            )
        if self.num_stages is not None and lengths:
            raise ValueError(
                f"figures for {self.num_stages} stages have lists of {sorted(lengths)} values; "
                f"give {self.num_stages} (comm: {self.num_stages - 1})"
            )

    def for_schedule(self, schedule: Schedule) -> StageFigures:
        """The figures for `schedule`'s stages; `ValueError` names why there are none."""
        S, R = schedule.num_stages, schedule.num_ranks
        if self.num_stages is not None:
            if self.num_stages != S:
                raise ValueError(
                    f"the figures are for {self.num_stages} stages and {schedule.name or 'it'} "
                    f"has {S}"
                )
            return self
        if S % R:
            raise ValueError(f"{S} stages do not divide over {R} ranks")
        return self.scaled(R / S)

    def scaled(self, factor: float, *, params: bool = True) -> StageFigures:
        """Every cost and byte times `factor` (the latency `comm` kept; `params`, and the
        gradient sums over a replicated stage's copies, `sync`, which scale with them, too
        if not `params`)."""

        def times(value):
            if value is None:
                return None
            if isinstance(value, tuple):
                return tuple(v * factor for v in value)
            return value * factor

        costs = dataclasses.replace(
            self.costs,
            **{
                k: times(getattr(self.costs, k))
                for k in Costs._KEYS
                if k != "comm" and (params or k != "sync")
            },
        )
        keys = [k for k in Sizes._KEYS if params or k != "params"]
        sizes = dataclasses.replace(self.sizes, **{k: times(getattr(self.sizes, k)) for k in keys})
        grads = times(self.grad_output) if params else self.grad_output
        by_kind = self.working_by_kind
        if by_kind is not None:
            by_kind = tuple({k: v * factor for k, v in d.items()} for d in by_kind)
        return dataclasses.replace(
            self, costs=costs, sizes=sizes, working=times(self.working), grad_output=grads,
            working_by_kind=by_kind,
        )  # fmt: skip

    def working_table(self, num_stages: int) -> tuple[float, ...]:
        return _table(self.working, num_stages)

    def grad_output_table(self, num_stages: int) -> tuple[float, ...]:
        return _table(self.grad_output, num_stages)


def _table(value, num_stages: int) -> tuple[float, ...]:
    if isinstance(value, tuple):
        return tuple(float(w) for w in value)
    return (float(value),) * num_stages


@dataclasses.dataclass(frozen=True)
class StageProfile:
    """Figures of one model for several splits into stages (a ``jpipe-stages/1`` file).

    Attributes:
      model: what was measured.
      microbatch_size: sequences per microbatch the figures are for.
      splits: ``{number of stages: StageFigures}``.
      blocks: ``{number of stages: blocks per stage}``, the split each is for.
      source: how the figures were made, for reports.
      warnings: what reading the file found doubtful but took (one line each).
    """

    model: str
    microbatch_size: int
    splits: dict[int, StageFigures]
    blocks: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    source: str = ""
    warnings: tuple[str, ...] = ()

    def for_schedule(self, schedule: Schedule) -> StageFigures:
        S = schedule.num_stages
        if S not in self.splits:
            raise ValueError(
                f"the {self.model} profile has no split into {S} stages (it has "
                f"{', '.join(map(str, sorted(self.splits)))})"
            )
        return self.splits[S]

    def scaled(self, factor: float, *, params: bool = True) -> StageProfile:
        return dataclasses.replace(
            self,
            splits={S: f.scaled(factor, params=params) for S, f in self.splits.items()},
        )


# -- reading profiles strictly ---------------------------------------------------------------

# What a number in a profile may be before it is taken for a unit other than the one the
# format says. Wide on purpose: they catch a profile written in GiB, TFLOP or GB/s (a
# factor of 1e9 or more off), not a slow or a large device.
FLOPS_PER_SECOND_RANGE = (1e8, 1e17)  # below a CPU core's GFLOP/s to 100 times an H100's
BYTES_PER_SECOND_RANGE = (1e5, 1e14)  # 100 kB/s to 100 TB/s
MOST_BYTES = 2.0**50  # a PiB: no stage keeps more for one microbatch
SECONDS_RANGE = (1e-9, 3600.0)  # a nanosecond to an hour: one piece, one microbatch
BYTES_PER_PARAM_RANGE = (1.0, 64.0)  # an 8-bit weight alone to fp32 with every copy


class _Reader:
    """Reads a profile's numbers strictly; errors and warnings name the field.

    A number must be an int or a float (not a string, not a bool), finite and
    non-negative; `plausible` checks say where it is off by a unit. The
    caller (`load_stage_profile`) puts the file's name in front of each line.
    """

    def __init__(self):
        self.warnings: list[str] = []

    def number(self, value, where: str, *, positive: bool = False) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where} is {value!r}; expected a number")
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            need = "positive" if positive else "finite and non-negative"
            raise ValueError(f"{where} is {value!r}; it must be {need}")
        return float(value)

    def numbers(self, values, where: str, n: int | None = None, *, what: str = "value"):
        if not isinstance(values, (list, tuple)):
            raise ValueError(f"{where} is {values!r}; expected a list of numbers")
        if n is not None and len(values) != n:
            raise ValueError(f"{where} has {len(values)} values, expected {n} (one per {what})")
        return [self.number(v, f"{where}[{i}]") for i, v in enumerate(values)]

    def integer(self, value, where: str, least: int = 1) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{where} is {value!r}; expected a whole number >= {least}")
        return value

    def rate(self, value: float, where: str, unit: str, bounds) -> float:
        low, high = bounds
        if not low <= value <= high:
            raise ValueError(
                f"{where} is {value:.4g} {unit}, outside any device's range ({low:.0e} to "
                f"{high:.0e}); the format wants {unit}, not a multiple such as T{unit} or G{unit}"
            )
        return value

    def bytes_(
        self, values, where: str, per: str = "microbatch", scale: float = 1.0
    ) -> list[float]:
        """Bytes of one `per` (each value times `scale`, for a file that keeps them per
        sequence): none under one byte or over a PiB; a fraction of a byte warned about."""
        for i, v in enumerate(values):
            was = "" if scale == 1 else f" ({v * scale:.4g} for a {per})"
            if 0 < v * scale < 1:
                raise ValueError(
                    f"{where}[{i}] is {v!r}{was}: under one byte for a {per}; the format "
                    "wants bytes (is it in GiB or MB?)"
                )
            if v * scale > MOST_BYTES:
                raise ValueError(f"{where}[{i}] is {v:.4g}{was}: over a PiB for a {per}")
        whole = lambda x: abs(x - round(x)) <= max(1e-6, 1e-9 * x)  # noqa: E731  (float error)
        fractions = [i for i, v in enumerate(values) if not whole(v * scale)]
        if fractions:
            i = fractions[0]
            self.warnings.append(
                f"{where}[{i}] is {values[i]!r}, not a whole number of bytes for a {per} "
                "(read as bytes; is it in another unit?)"
            )
        return [v * scale for v in values]

    def seconds(self, values, where: str, *, positive: bool = False) -> list[float]:
        low, high = SECONDS_RANGE
        for i, v in enumerate(values):
            if v > high:
                raise ValueError(
                    f"{where}[{i}] is {v:.4g} s for one microbatch, over an hour; the format "
                    "wants seconds (is it in milliseconds?)"
                )
            if 0 < v < low:
                raise ValueError(
                    f"{where}[{i}] is {v:.4g} s for one microbatch, under a nanosecond; the "
                    "format wants seconds (is it in hours, or a rate?)"
                )
            if positive and v == 0:
                raise ValueError(f"{where}[{i}] is 0; every forward takes some time")
        return values


def _field(d, key, where: str = ""):
    if not isinstance(d, dict):
        raise ValueError(f"{where or 'the profile'} is {type(d).__name__}; expected an object")
    if key not in d:
        raise ValueError(f"the field {where + '.' if where else ''}{key} is missing")
    return d[key]


def stage_profile_from_json(d: dict, rates: dict | None = None) -> StageProfile:
    """Reads a ``jpipe-stages/1`` object (see docs/search.md); errors name the bad field.

    Each split holds per stage the FLOPs of its F, I and W pieces and of a
    recompute, and its bytes; times are FLOPs over the file's
    ``rates.flops_per_second``, transfers bytes over ``partner_bytes_per_s``
    (an eviction, and the activation sent to the next stage) and
    ``host_bytes_per_s`` (an offload). `rates` overrides any of the three.
    Numbers are read strictly (`_Reader`): a FLOP count under one, bytes
    under one or over a PiB, a rate outside any device's range, or a stage
    whose forward takes nothing is refused; a fraction of a byte is kept in
    `StageProfile.warnings`.
    """
    if not isinstance(d, dict) or d.get("format") != STAGE_PROFILE_FORMAT:
        found = d.get("format") if isinstance(d, dict) else type(d).__name__
        raise ValueError(
            f"not a jpipe stage profile: 'format' is {found!r}, not {STAGE_PROFILE_FORMAT!r}"
        )
    read = _Reader()
    raw_rates = _field(d, "rates")
    if not isinstance(raw_rates, dict):
        raise ValueError(f"rates is {raw_rates!r}; expected an object of named rates")
    file_rates = {k: read.number(v, f"rates.{k}", positive=True) for k, v in raw_rates.items()}
    unknown = sorted(set(rates or ()) - set(file_rates))
    if unknown:
        raise ValueError(f"unknown rates {unknown}; the rates are {sorted(file_rates)}")
    r = {**file_rates, **{k: read.number(v, f"--rate {k}", positive=True)
                          for k, v in (rates or {}).items()}}  # fmt: skip
    for key in ("flops_per_second", "partner_bytes_per_s", "host_bytes_per_s"):
        _field(r, key, "rates")
    flops = read.rate(r["flops_per_second"], "rates.flops_per_second", "FLOP/s",
                      FLOPS_PER_SECOND_RANGE)  # fmt: skip
    partner = read.rate(r["partner_bytes_per_s"], "rates.partner_bytes_per_s", "B/s",
                        BYTES_PER_SECOND_RANGE)  # fmt: skip
    host = read.rate(r["host_bytes_per_s"], "rates.host_bytes_per_s", "B/s",
                     BYTES_PER_SECOND_RANGE)  # fmt: skip
    model = _field(d, "model")
    microbatch_size = read.integer(_field(d, "microbatch_size"), "microbatch_size")
    entries = _field(d, "splits")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"splits is {entries!r}; expected a list of splits")
    splits, blocks = {}, {}
    for k, entry in enumerate(entries):
        S = read.integer(_field(entry, "stages", f"splits[{k}]"), f"splits[{k}].stages")
        where = f"splits[stages={S}]"
        if S in splits:
            raise ValueError(f"{where} comes twice")

        def per_stage(key, entry=entry, S=S, where=where):
            return read.numbers(_field(entry, key, where), f"{where}.{key}", S, what="stage")

        fl = _field(entry, "flops", where)
        counts = {}
        for kind in ("F", "I", "W", "recompute"):
            values = read.numbers(_field(fl, kind, f"{where}.flops"), f"{where}.flops.{kind}", S,
                                  what="stage")  # fmt: skip
            for i, v in enumerate(values):
                if 0 < v < 1:
                    raise ValueError(
                        f"{where}.flops.{kind}[{i}] is {v!r}: under one FLOP; the format wants "
                        "FLOPs (is it in TFLOP or GFLOP?)"
                    )
                if v / flops > SECONDS_RANGE[1]:
                    raise ValueError(
                        f"{where}.flops.{kind}[{i}] is {v:.4g} FLOPs, over an hour at "
                        f"{flops:.4g} FLOP/s"
                    )
            counts[kind] = values
        if not all(counts["F"]):
            i = counts["F"].index(0.0)
            raise ValueError(f"{where}.flops.F[{i}] is 0; every stage's forward does some work")
        act = read.bytes_(per_stage("activation"), f"{where}.activation")
        out = read.bytes_(per_stage("output"), f"{where}.output")
        costs = Costs(
            F=[x / flops for x in counts["F"]],
            I=[x / flops for x in counts["I"]],
            W=[x / flops for x in counts["W"]],
            recompute=[x / flops for x in counts["recompute"]],
            comm=[x / partner for x in out[:-1]] if S > 1 else 0.0,
            evict=[x / partner for x in act],
            offload=[x / host for x in act],
        )
        sizes = Sizes(
            activation=act,
            carry=read.bytes_(per_stage("carry"), f"{where}.carry"),
            input=read.bytes_(per_stage("input"), f"{where}.input"),
            params=read.bytes_(per_stage("params"), f"{where}.params", "stage"),
        )
        grads = (
            tuple(read.bytes_(per_stage("grad_output"), f"{where}.grad_output", "stage"))
            if "grad_output" in entry
            else 0.0
        )
        splits[S] = StageFigures(
            costs,
            sizes,
            working=tuple(read.bytes_(per_stage("working"), f"{where}.working")),
            grad_output=grads,
            num_stages=S,
            source=str(d.get("source", "")),
        )
        if "blocks_per_stage" in entry:
            got = _field(entry, "blocks_per_stage", where)
            if not isinstance(got, list) or len(got) != S:
                raise ValueError(f"{where}.blocks_per_stage is {got!r}; expected {S} counts")
            blocks[S] = tuple(
                read.integer(b, f"{where}.blocks_per_stage[{i}]", 0) for i, b in enumerate(got)
            )
    return StageProfile(
        model=str(model),
        microbatch_size=microbatch_size,
        splits=splits,
        blocks=blocks,
        source=str(d.get("source", "")),
        warnings=tuple(read.warnings),
    )


# -- the trainer's profile: figures per layer, any split -----------------------------------

# The planner's profile format (`jpipe.planner`'s FORMAT), which ``train.py
# --config.profile=True`` writes; named here, not imported, since the planner imports this
# module. tests/test_search_profile.py checks that the two agree.
TRAINER_PROFILE_FORMAT = "jpipe-profile/2"
# Links a profile does not measure (the trainer's are "unmeasured", infinitely fast): the
# rates gpt2_small.json assumes, NVLink 4 between ranks and pinned host memory.
ASSUMED_PARTNER_BYTES_PER_S = 200e9
ASSUMED_HOST_BYTES_PER_S = 25e9
_PART_KEYS = ("F", "I", "W", "activation", "output", "params", "grad_output")


def balanced_blocks(num_blocks: int, num_stages: int) -> tuple[int, ...]:
    """Blocks per stage as the trainer splits them (`jpipe.models.split_layers`, balanced):
    ``num_blocks // num_stages`` each, the remainder one each to the middle stages, then
    the first, then the last (they hold the embedding and the head); `ValueError` where a
    middle stage would get none."""
    base, extra = divmod(num_blocks, num_stages)
    counts = [base] * num_stages
    for s in (list(range(1, num_stages - 1)) + [0, num_stages - 1])[:extra]:
        counts[s] += 1
    if any(c == 0 for c in counts[1:-1]):
        raise ValueError(
            f"{num_blocks} blocks cannot make {num_stages} stages (a middle stage would hold "
            f"none; at most {num_blocks + 2})"
        )
    return tuple(counts)


@dataclasses.dataclass(frozen=True)
class LayerProfile:
    """Figures of one model per layer, from which each split into stages is formed.

    Read from the planner's profile format (``jpipe-profile/2``), which
    ``train.py --config.profile=True`` writes. A stage of blocks ``a..b``
    gets the sums of their figures, the first stage the embedding's too, the
    last the head's (`balanced_blocks`: the trainer's split), so that any
    number of stages, and so every V schedule, has figures.

    Attributes:
      model: what was measured.
      microbatch_size: sequences per microbatch the figures are for.
      first, last: the embedding's and the head's figures (``_PART_KEYS``: F,
        I, W seconds; activation, output, params, grad_output bytes). From a
        trainer's profile, which measures whole stages, they are its first
        (last) stage less its blocks, and may be negative in a term (on the
        small GPT the first stage keeps fewer residual bytes than a middle
        stage of as many blocks; noisy times do the same). A stage's sum
        is never below 0. Of the measured split, the first and last stages come
        back exactly, the middle ones at their mean.
      block_figures: each block's figures, in order.
      working_factor: a stage's working memory in units of its residual
        bytes (the runtime's measured term).
      partner_bytes_per_s, host_bytes_per_s: link rates (evictions and sends;
        offloads).
      only_stages: the one number of stages the figures hold when blocks
        cannot be told from the embedding and head (a profile of one or two
        measured stages); None otherwise.
      source, warnings: how the figures were made; what reading found doubtful.
      factor: the scale of every per-microbatch figure against the measured
        one (`scaled`: ``--batch`` with another microbatch size; linear).
    """

    model: str
    microbatch_size: int
    first: dict
    block_figures: tuple[dict, ...]
    last: dict
    working_factor: float
    partner_bytes_per_s: float
    host_bytes_per_s: float
    only_stages: int | None = None
    source: str = ""
    warnings: tuple[str, ...] = ()
    factor: float = 1.0
    _cache: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def num_blocks(self) -> int:
        return len(self.block_figures)

    def split(self, num_stages: int) -> tuple[int, ...]:
        """Blocks per stage of the split into `num_stages` (`balanced_blocks`)."""
        if self.only_stages is not None and num_stages != self.only_stages:
            raise ValueError(
                f"the {self.model} profile measured {self.only_stages} stage"
                f"{'s' if self.only_stages > 1 else ''} and no middle one, so a block's own "
                f"figures are unknown and it has no split into {num_stages}; profile a run "
                "with 3 or more stages (train.py --config.mesh.pipe=4 --config.profile=True)"
            )
        return balanced_blocks(self.num_blocks, num_stages)

    def stage_figures(self, num_stages: int) -> StageFigures:
        """The figures of the split into `num_stages` stages (see the class docstring)."""
        if num_stages not in self._cache:
            self._cache[num_stages] = self._form(num_stages)
        fig = self._cache[num_stages]
        return fig if self.factor == 1.0 else fig.scaled(self.factor, params=False)

    def _form(self, S: int) -> StageFigures:
        counts = self.split(S)
        stages, at = [], 0
        for s, k in enumerate(counts):
            parts = list(self.block_figures[at : at + k])
            at += k
            if s == 0:
                parts.insert(0, self.first)
            if s == S - 1:
                parts.append(self.last)
            total = {key: max(0.0, sum(p[key] for p in parts)) for key in _PART_KEYS}
            total["output"] = max(0.0, parts[-1]["output"])  # its last layer's, not a sum
            stages.append(total)
        col = lambda key: [st[key] for st in stages]  # noqa: E731
        act, out = col("activation"), col("output")
        costs = Costs(
            F=col("F"),
            I=col("I"),
            W=col("W"),
            recompute=col("F"),
            comm=[x / self.partner_bytes_per_s for x in out[:-1]] if S > 1 else 0.0,
            evict=[x / self.partner_bytes_per_s for x in act],
            offload=[x / self.host_bytes_per_s for x in act],
        )
        sizes = Sizes(
            activation=act,
            # W needs its layers' inputs: the carry is taken as large as the residuals, as
            # the planner takes it (the profile does not measure it; conservative)
            carry=act,
            input=[0.0] + out[:-1],  # an FC keeps its input: the stage before's output
            params=col("params"),
        )
        return StageFigures(
            costs,
            sizes,
            working=tuple(self.working_factor * a for a in act),
            grad_output=tuple(col("grad_output")),
            num_stages=S,
            source=self.source,
        )

    def for_schedule(self, schedule: Schedule) -> StageFigures:
        return self.stage_figures(schedule.num_stages)

    def scaled(self, factor: float, *, params: bool = True) -> LayerProfile:
        """Every per-microbatch cost and byte times `factor`; parameters stay (`params`
        must be False: a model's parameters do not scale with its microbatch)."""
        if params:
            raise ValueError("a layer profile scales its per-microbatch figures only")
        return dataclasses.replace(self, factor=self.factor * factor, _cache=self._cache)


def layer_profile_from_json(
    d: dict, rates: dict | None = None, device: str | None = None
) -> LayerProfile:
    """Reads a ``jpipe-profile/2`` object into per-layer figures; errors name the bad field.

    Two shapes of that format are read:

    - per layer (``layer_kinds`` ``embedding``, ``block``..., ``head``; the
      planner's own and Sailor's profiles): each layer's figures as they are;
    - per measured stage (``layer_kinds`` all ``block`` with
      ``layer_blocks``, as ``train.py --config.profile=True`` writes it, one
      "layer" a stage): a block's figures are the middle stages' sums over
      their blocks (their median would hide a slow stage), the embedding's
      the first stage less its blocks, the head's the last stage less its
      blocks. With one or two stages there is no middle stage: only the
      measured split is formed.

    Times are the device's (`device`, or the only one) at T = 1 and the
    smallest microbatch size measured there; a backward not split into I and
    W is halved. Bytes: ``params`` (parameters at T = 1) times the memory
    terms' bytes per parameter, ``grad_output`` the gradients' share of it,
    residual and output bytes per sequence times the microbatch size, the
    working memory ``working_factor`` times a stage's residuals. Transfers
    use the profile's own link (``intra_node``, among the most GPUs of a node
    it has) when it is measured, else
    `ASSUMED_PARTNER_BYTES_PER_S` and `ASSUMED_HOST_BYTES_PER_S`; `rates`
    (``partner_bytes_per_s``, ``host_bytes_per_s``) overrides them.
    """
    if not isinstance(d, dict) or d.get("format") != TRAINER_PROFILE_FORMAT:
        found = d.get("format") if isinstance(d, dict) else type(d).__name__
        raise ValueError(f"not a jpipe profile: 'format' is {found!r}, not "
                         f"{TRAINER_PROFILE_FORMAT!r}")  # fmt: skip
    read = _Reader()
    n, layer_blocks, per_stage = _layer_kinds(d, read)
    device, mbs, F, I, W = _layer_times(d, device, n, read)
    act, out, params, grads, working_factor = _layer_bytes(d, n, mbs, read)
    layers = [
        {"F": F[j], "I": I[j], "W": W[j], "activation": act[j], "output": out[j],
         "params": params[j], "grad_output": grads[j]}
        for j in range(n)
    ]  # fmt: skip
    partner, host, links = _link_rates(d, device, rates, read)
    source = (
        f"{d.get('model', 'a model')} on {device}, microbatches of {mbs}, "
        f"{'measured stages' if per_stage else 'layers'} of a jpipe-profile/2; links "
        f"{links} ({partner / 1e9:.4g} GB/s between ranks, {host / 1e9:.4g} GB/s to the host)"
    )
    model = str(_field(d, "model"))
    common = dict(
        model=model, microbatch_size=mbs, working_factor=working_factor,
        partner_bytes_per_s=partner, host_bytes_per_s=host, source=source,
    )  # fmt: skip
    if not per_stage:
        return LayerProfile(first=layers[0], block_figures=tuple(layers[1:-1]), last=layers[-1],
                            warnings=tuple(read.warnings), **common)  # fmt: skip
    return _from_measured_stages(layers, layer_blocks, read, common)


def _layer_kinds(d: dict, read: _Reader) -> tuple[int, list[int] | None, bool]:
    """A ``jpipe-profile/2``'s shape (`layer_profile_from_json`): ``(n, layer_blocks,
    per_stage)``, its number of layers, the blocks of each (None where it does not say) and
    whether its layers are the trainer's measured stages rather than layers."""
    kinds = _field(d, "layer_kinds")
    if not isinstance(kinds, list) or not kinds or not all(isinstance(k, str) for k in kinds):
        raise ValueError(f"layer_kinds is {kinds!r}; expected a list of layer kinds")
    n = len(kinds)
    layer_blocks = d.get("layer_blocks")
    if layer_blocks is not None:
        if not isinstance(layer_blocks, list) or len(layer_blocks) != n:
            raise ValueError(f"layer_blocks is {layer_blocks!r}; expected {n} counts")
        layer_blocks = [
            read.integer(b, f"layer_blocks[{i}]", 0) for i, b in enumerate(layer_blocks)
        ]
    per_stage = layer_blocks is not None and all(k == "block" for k in kinds)
    if not per_stage and not (
        n >= 2 and kinds[0] == "embedding" and kinds[-1] == "head"
        and all(k == "block" for k in kinds[1:-1]) and layer_blocks is None
    ):  # fmt: skip
        raise ValueError(
            f"layer_kinds is {kinds!r}: the search reads either layers (embedding, block..., "
            "head) or measured stages (all block, with layer_blocks)"
        )
    return n, layer_blocks, per_stage


def _layer_times(d: dict, device: str | None, n: int, read: _Reader):
    """The `n` layers' times in a ``jpipe-profile/2`` (`layer_profile_from_json`):
    ``(device, mbs, F, I, W)``, the device read (`device`, or the only one), the smallest
    microbatch size it has at T = 1, and each layer's forward, input-gradient and
    weight-gradient seconds there (a backward not split into I and W halved)."""
    devices = _field(d, "devices")
    if not isinstance(devices, dict) or not devices:
        raise ValueError(f"devices is {devices!r}; expected an object of device types")
    if device is None:
        if len(devices) > 1:
            raise ValueError(f"devices has {', '.join(sorted(devices))}; say which (--device)")
        device = next(iter(devices))
    if device not in devices:
        raise ValueError(f"devices has no {device!r} (it has {', '.join(sorted(devices))})")
    entries = _field(devices[device], "times", f"devices.{device}")
    if not isinstance(entries, list):
        raise ValueError(f"devices.{device}.times is {entries!r}; expected a list")
    at_t1 = []
    for i, e in enumerate(entries):
        where = f"devices.{device}.times[{i}]"
        b = read.integer(_field(e, "microbatch_size", where), f"{where}.microbatch_size")
        t = read.integer(_field(e, "tensor_parallel", where), f"{where}.tensor_parallel")
        if t == 1:
            at_t1.append((b, i, e))
    if not at_t1:
        raise ValueError(
            f"devices.{device}.times has no entry at tensor_parallel 1 (the search's stages "
            "run on one device each)"
        )
    mbs, i, e = min(at_t1, key=lambda x: x[:2])
    where = f"devices.{device}.times[{i}]"
    seconds = lambda key, positive=False: read.seconds(  # noqa: E731
        read.numbers(_field(e, key, where), f"{where}.{key}", n, what="layer"),
        f"{where}.{key}",
        positive=positive,
    )
    F = seconds("forward", positive=True)
    if e.get("input_grad") is not None and e.get("weight_grad") is not None:
        I, W = seconds("input_grad"), seconds("weight_grad")
    else:
        back = seconds("backward")
        I = W = [x / 2 for x in back]
    return device, mbs, F, I, W


def _layer_bytes(d: dict, n: int, mbs: int, read: _Reader):
    """The `n` layers' bytes in a ``jpipe-profile/2`` (`layer_profile_from_json`), for
    microbatches of `mbs` sequences: ``(activation, output, params, grad_output,
    working_factor)``, the residual and output bytes per microbatch, the parameters' bytes
    (all the memory terms' bytes per parameter) and their gradients', and the working
    memory in units of a stage's residuals."""
    params_by_t = _field(d, "params")
    acts_by_t = _field(d, "activation_bytes")
    for name, table in (("params", params_by_t), ("activation_bytes", acts_by_t)):
        if not isinstance(table, dict) or "1" not in table:
            raise ValueError(f"{name} has no entry for tensor_parallel 1 ('1')")
    counts = read.numbers(params_by_t["1"], "params[1]", n, what="layer")
    for j, c in enumerate(counts):
        if 0 < c < 1:
            raise ValueError(
                f"params[1][{j}] is {c!r}: under one parameter; the format wants a count of "
                "parameters (is it in millions?)"
            )
        if c > MOST_BYTES:
            raise ValueError(f"params[1][{j}] is {c:.4g} parameters, implausibly many")
    # bytes per sequence in the file; checked per microbatch
    per = f"microbatch of {mbs} sequences"
    act = read.numbers(acts_by_t["1"], "activation_bytes[1]", n, what="layer")
    act = read.bytes_(act, "activation_bytes[1]", per, scale=mbs)
    out = read.numbers(_field(d, "output_bytes"), "output_bytes", n, what="layer")
    out = read.bytes_(out, "output_bytes", per, scale=mbs)
    terms = _field(d, "memory_terms")
    per_param = {
        k: read.number(_field(terms, k, "memory_terms"), f"memory_terms.{k}")
        for k in ("weight_bytes", "gradient_bytes", "optimizer_bytes", "buffer_bytes")
    }
    total = sum(per_param.values())
    low, high = BYTES_PER_PARAM_RANGE
    if not low <= total <= high:
        raise ValueError(
            f"memory_terms: {total:.4g} bytes per parameter (weights, gradients, optimizer "
            f"state, buffers), outside {low:g} to {high:g}; the format wants bytes"
        )
    working_factor = read.number(
        _field(terms, "working_factor", "memory_terms"), "memory_terms.working_factor"
    )
    if working_factor > 100:
        read.warnings.append(
            f"memory_terms.working_factor is {working_factor:.4g}: a piece's working memory "
            "over 100 times its stage's residuals"
        )
    params = [total * c for c in counts]
    grads = [per_param["gradient_bytes"] * c for c in counts]
    return act, out, params, grads, working_factor


def _link_rates(d: dict, device: str, rates: dict | None, read: _Reader):
    """The transfer rates for a ``jpipe-profile/2`` (`layer_profile_from_json`):
    ``(partner, host, links)``, bytes per second between ranks and to the host, and how
    the first was found (``"measured"``: the profile's own link among the most GPUs of one
    node of `device`; ``"assumed"``; ``"given"`` in `rates`, which override both)."""
    unknown = sorted(set(rates or ()) - {"partner_bytes_per_s", "host_bytes_per_s"})
    if unknown:
        raise ValueError(
            f"unknown rates {unknown}; a jpipe-profile/2 takes partner_bytes_per_s and "
            "host_bytes_per_s (its times are measured, not FLOPs over a rate)"
        )
    partner, links = ASSUMED_PARTNER_BYTES_PER_S, "assumed"
    mine = [(k, link) for k, link in enumerate(d.get("intra_node") or ())
            if isinstance(link, dict) and link.get("device") == device]  # fmt: skip
    if mine:  # the link among the most GPUs of one node the profile has
        gpus = lambda x: x[1]["gpus"] if isinstance(x[1].get("gpus"), int) else 0  # noqa: E731
        k, link = max(mine, key=lambda x: (gpus(x), -x[0]))
        v = _field(link, "max_bytes_per_s", f"intra_node[{k}]")
        if v != math.inf:  # infinite: not measured (the trainer's)
            v = read.number(v, f"intra_node[{k}].max_bytes_per_s", positive=True)
            partner = read.rate(v, f"intra_node[{k}].max_bytes_per_s", "B/s",
                                BYTES_PER_SECOND_RANGE)  # fmt: skip
            links = "measured"
    host = ASSUMED_HOST_BYTES_PER_S
    for key, value in (rates or {}).items():
        value = read.rate(read.number(value, f"--rate {key}", positive=True), f"--rate {key}",
                          "B/s", BYTES_PER_SECOND_RANGE)  # fmt: skip
        if key == "partner_bytes_per_s":
            partner, links = value, "given"
        else:
            host = value
    return partner, host, links


def _from_measured_stages(stages, blocks_per_stage, read: _Reader, common) -> LayerProfile:
    """Per-layer figures from the trainer's measured stages (`layer_profile_from_json`)."""
    S = len(stages)
    zero = {key: 0.0 for key in _PART_KEYS}
    middle = [s for s in range(1, S - 1) if blocks_per_stage[s]]
    if S > 1 and middle:
        n = sum(blocks_per_stage[s] for s in middle)
        block = {key: sum(stages[s][key] for s in middle) / n for key in _PART_KEYS}
        block["output"] = stages[middle[0]]["output"]  # a block's output is not a sum
    else:  # no middle stage: a block's figures cannot be told from the embedding's
        block = None
    if block is None:
        # Blocks of zero figures, the stages' own as the embedding and head: this forms
        # the measured split (and only it: `only_stages`).
        block = dict(zero, output=stages[0]["output"])
        first, last = dict(stages[0]), dict(stages[-1])
        if S == 1:
            last = dict(zero, output=stages[0]["output"])
        return LayerProfile(
            first=first, block_figures=(block,) * sum(blocks_per_stage), last=last,
            only_stages=S, warnings=tuple(read.warnings), **common,
        )  # fmt: skip
    k0, kl = blocks_per_stage[0], blocks_per_stage[-1]
    first = {key: stages[0][key] - k0 * block[key] for key in _PART_KEYS}
    first["output"] = block["output"]  # the embedding's output is a block's input
    last = {key: stages[-1][key] - kl * block[key] for key in _PART_KEYS}
    last["output"] = stages[-1]["output"]
    for name, part, s in (("embedding", first, 0), ("head", last, S - 1)):
        short = [key for key in ("F", "I", "W") if part[key] < 0]
        if short:  # noise, or blocks that differ: a stage without blocks then costs 0 there
            read.warnings.append(
                f"stage {s} measured less {'/'.join(short)} time than its "
                f"{blocks_per_stage[s]} block(s) at the middle stages' rate, so the "
                f"{name}'s own is taken as 0 where a stage holds it alone"
            )
    return LayerProfile(
        first=first, block_figures=(block,) * sum(blocks_per_stage), last=last,
        warnings=tuple(read.warnings), **common,
    )  # fmt: skip


PROFILES_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "_data", "profiles")


def load_stage_profile(
    path: str | dict, rates: dict | None = None, *, device: str | None = None
) -> StageProfile | LayerProfile:
    """Reads a profile for the search: a file, one shipped with jpipe by name
    (``gpt2_small``), or an object already parsed.

    A ``jpipe-stages/1`` profile (figures per split, `stage_profile_from_json`)
    gives a `StageProfile`; a ``jpipe-profile/2`` one (the planner's format,
    which ``train.py --config.profile=True`` writes; `layer_profile_from_json`)
    a `LayerProfile`, which forms any split. `rates` overrides the file's
    rates; `device` picks a device type of a ``jpipe-profile/2``. Errors are
    one line naming the file and the field; what the reading found doubtful
    but took is issued as `warnings.warn` and kept in the result's `warnings`.
    """
    name = "the profile"
    d = path
    if not isinstance(path, dict):
        if not os.path.exists(path) and os.sep not in path and not path.endswith(".json"):
            shipped = os.path.join(PROFILES_DIR, path + ".json")
            if not os.path.exists(shipped):
                have = sorted(f[:-5] for f in os.listdir(PROFILES_DIR) if f.endswith(".json"))
                raise ValueError(f"no profile file {path!r} and none shipped by that name ({have})")
            path = shipped
        name, d = path, read_json(path, "profile")
    kind = d.get("format") if isinstance(d, dict) else None
    try:
        if kind == TRAINER_PROFILE_FORMAT:
            profile = layer_profile_from_json(d, rates, device)
        else:
            if device is not None:
                raise ValueError(f"a device is picked only in a {TRAINER_PROFILE_FORMAT} profile")
            if kind != STAGE_PROFILE_FORMAT:
                raise ValueError(
                    f"'format' is {kind!r}; the search reads {STAGE_PROFILE_FORMAT!r} (stage "
                    f"figures per split) and {TRAINER_PROFILE_FORMAT!r} (what train.py "
                    "--config.profile=True writes)"
                )
            profile = stage_profile_from_json(d, rates)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    for line in profile.warnings:
        warnings.warn(f"{name}: {line}", stacklevel=2)
    return dataclasses.replace(profile, warnings=tuple(f"{name}: {w}" for w in profile.warnings))


# -- what the lowerings run ------------------------------------------------------------------


PER_RANK_FASTER = 0.01
"""The least share faster the per-rank lowering's best must be for the search's and the
planner's command lines to name it beside the SPMD layout's."""


def lowering_runs(layout: str, kind: str) -> bool:
    """Whether the lowering of `layout` runs memory actions of `kind`, as its
    `LoweringKind.memory_actions` declares (each held to its lowering's own pass by
    tests/test_schedule_search.py)."""
    if kind not in MEMORY_KINDS:
        raise ValueError(f"{kind!r} is not a memory action ({', '.join(MEMORY_KINDS)})")
    return kind in layout_kind(layout).memory_actions


def runs_schedule(layout: str, schedule: Schedule) -> bool:
    """Whether the lowering of `layout` runs every memory action of `schedule`."""
    return all(lowering_runs(layout, a.kind) for _, _, a in schedule.all_actions() if a.is_memory)


# -- bytes per device ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeviceBytes:
    """A schedule's bytes per rank, and per device under a layout (module docstring).

    Attributes:
      layout: ``"spmd"`` or ``"mpmd"``.
      params: per rank, the parameter bytes its device holds under `layout`.
      values: per rank, the most residuals, carries and kept inputs it holds at once.
      working: per rank, its largest piece's working memory.
      device: per rank, what the device of that rank allocates under `layout`.
      grad_output: the gradients every device holds beside its accumulator.
      buffers: ``(residual, carry)`` bytes of the buffers the layout's program sizes,
        held in place of the values (the SPMD program's); None where it has none.
      held: per rank, its device's terms as the layout's byte model counts them
        (`jpipe.lower.bytes.HeldBytes`); not in `to_json`.
    """

    layout: str
    params: tuple[float, ...]
    values: tuple[float, ...]
    working: tuple[float, ...]
    device: tuple[float, ...]
    grad_output: float = 0.0
    buffers: tuple[float, float] | None = None
    held: tuple[HeldBytes, ...] = dataclasses.field(default=(), repr=False, compare=False)

    @property
    def most(self) -> float:
        return max(self.device)

    @property
    def fullest(self) -> int:
        """The rank whose device holds the most (the first, if several)."""
        return max(range(len(self.device)), key=lambda r: (self.device[r], -r))

    def parts(self, rank: int) -> dict[str, float]:
        """What the device of `rank` holds, term by term (under SPMD, each the largest rank's)."""
        return self.held[rank].parts()

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "held"}


def _rank_figures(schedule: Schedule, figures: StageFigures):
    """Per rank, what it needs besides its live values: ``(params, grads, working)``, its
    stages' ``params`` and ``grad_output`` bytes and its largest piece's working memory
    (a replicated stage's on every rank that holds a copy)."""
    S, R = schedule.num_stages, schedule.num_ranks
    params_of = figures.sizes.table(S)["params"]
    grads_of = figures.grad_output_table(S)
    working_of = figures.working_table(S)
    stages_of = [[] for _ in range(R)]  # `Schedule.stages_of` of every rank, in one pass
    for s, ranks in enumerate(schedule.stage_ranks):
        for r in ranks:
            if 0 <= r < R:
                stages_of[r].append(s)
    own = [sum(params_of[s] for s in stages) for stages in stages_of]
    grads = [sum(grads_of[s] for s in stages) for stages in stages_of]
    working = [max((working_of[s] for s in stages), default=0.0) for stages in stages_of]
    return own, grads, working


def _need(
    ranks, values: Sequence[float], buffers=None, busy=(), packed_everywhere: bool = True
) -> RankBytes:
    """What each rank needs (`_rank_figures`, and its live `values`), for a byte model.

    The search's pipelines run on one mesh, so under the per-rank lowering every rank
    holds the packed parameters and the optimizer state on them whole
    (`RankBytes.packed_everywhere`; docs/design.md, "not yet the rank's own"); with a
    mesh per rank (`train.py`'s per-rank lowering) each holds its own.
    """
    own, grads, working = ranks
    return RankBytes(
        params=own, values=values, working=working, grads=grads, tick_buffers=buffers,
        packed_everywhere=packed_everywhere, busy=busy,
    )  # fmt: skip


def _allowances(schedule: Schedule, figures: StageFigures, layout: str, budget: float, ranks=None):
    """Per rank: the parameter bytes its device holds under `layout`, its working memory,
    and how many bytes of live values its device may hold within `budget` (what the
    layout's byte model leaves of it beside every other term). `ranks`: `_rank_figures`,
    if at hand."""
    ranks = ranks or _rank_figures(schedule, figures)
    held = layout_kind(layout).byte_model().device_bytes(_need(ranks, (0.0,) * len(ranks[0])))
    return [h.params for h in held], ranks[2], [h.room(budget) for h in held]


# Transfers whose destination takes its buffer: at the copy's issue, when the rank reaches it.
_TAKES_AT_ISSUE = frozenset(("EVICT", "LOAD", "RELOAD_START"))
# The kinds whose end the rank waits for before it goes on (none of `_TAKES_AT_ISSUE`).
_MOVES_ON = frozenset(COMPUTE_KINDS) | {"OFFLOAD_END", "RELOAD_END"}


def _curves(sim: Simulation, figures: StageFigures):
    """Per rank, its live values in time: a list of ``(time, live after, key)``.

    The simulator's own events (what each action takes and gives back, and
    when; what a partner holds for a rank included), with one change that can
    only add bytes: a transfer's destination takes its buffer when the rank
    issues the copy (as JAX allocates a `device_put`'s result), not when a
    busy link or copy engine starts it; its source is still freed when it
    lands. `key` is the `(stage, microbatch)` whose bytes changed.
    """
    rows, _, events = _events(sim, figures)
    curves = []
    for row in events:
        live, curve = 0.0, []
        add = curve.append
        for when, delta, (r, i) in row:
            live += delta
            a = rows[r][i]
            add((when[0], live, (a.stage, a.microbatch)))
        curves.append(curve)
    return curves


# The actions that run a piece of the stage (the others move or drop values).
_PIECES = frozenset(("F", "FC", "B", "I", "W", "RECOMPUTE"))


def _busy(sim: Simulation, figures: StageFigures) -> tuple[list[float], list[float]]:
    """Per rank, the most it holds while a piece runs: the live values when each piece
    starts (its own takes not yet counted) plus that piece's working memory
    (`StageFigures.working_by_kind`, the stage's `working` for a kind it lacks), or its
    peak of live values where that is more. What the per-rank lowering's account
    counts (`jpipe.RankPrograms.account`). And, from the same walk, each rank's peak of
    live values alone (at least 0), as `_curves` gives it."""
    rows, starts, events = _events(sim, figures)
    S = sim.schedule.num_stages
    by_kind, working = figures.working_by_kind, figures.working_table(S)
    out, peaks = [], []
    for r, row in enumerate(events):
        # at a piece's start, before its own takes (`_live_events` keys a start (t, 1, i, 0))
        probes = [((starts[r][i], 1, i, -1), a) for i, a in enumerate(rows[r]) if a.kind in _PIECES]
        merged = sorted([(k, d, None) for k, d, _ in row] + [(k, 0.0, a) for k, a in probes],
                        key=operator.itemgetter(0))  # fmt: skip
        live = most = peak = 0.0
        for _, delta, a in merged:
            if a is None:
                live += delta
                peak = max(peak, live)
            else:
                kinds = by_kind[a.stage] if by_kind is not None else {}
                most = max(most, live + kinds.get(a.kind, working[a.stage]))
        out.append(max(most, peak))
        peaks.append(peak)
    return out, peaks


def _starts_of(sim: Simulation, rows):
    """Each action's start as the live events take it: a transfer that takes its buffer
    at issue starts when the rank reaches it (`_curves`)."""
    starts = sim.starts
    if sim.schedule.has_memory_actions:
        first = min((min(row) for row in sim.starts if row), default=0.0)
        starts = []
        for r, row in enumerate(rows):
            issued, out, ends = first, list(sim.starts[r]), sim.ends[r]
            for i, a in enumerate(row):
                kind = a.kind
                if kind in _TAKES_AT_ISSUE:
                    out[i] = min(out[i], issued)
                elif kind in _MOVES_ON:
                    issued = ends[i]  # the rank moves on when these end
            starts.append(out)
    return starts


def _events(sim: Simulation, figures: StageFigures):
    """The schedule's rows, each action's start as the events take it, and per rank its
    changes of live bytes in order (`_curves`)."""
    schedule = sim.schedule
    S, M, R = schedule.num_stages, schedule.num_microbatches, schedule.num_ranks
    size = figures.sizes.table(S)
    rows = analyze(schedule).rows  # validated already (simulated)
    starts = _starts_of(sim, rows)
    events = _live_events(
        rows, starts, sim.ends, starts, S, M, R,
        size["activation"], size["input"], size["carry"],
    )  # fmt: skip
    return rows, starts, events


@dataclasses.dataclass(frozen=True)
class _Fit:
    """How far a simulated schedule is from fitting (the local search's objective)."""

    area: float  # sum over ranks of the bytes x time above the allowance
    peak_over: float  # sum over ranks of the peak above it (a zero-length spike has no area)
    fullest: int  # the rank furthest over (or fullest, when none is over)
    at_peak: tuple[tuple[int, int], ...]  # keys live on that rank at its peak

    @property
    def fits(self) -> bool:
        return self.peak_over <= 0


def _fit(curves, room: Sequence[float]) -> tuple[_Fit, list]:
    """How far the live values (`_curves`) are from `room` per rank, and each rank's peak."""
    area = peak_over = 0.0
    worst, worst_over, worst_at, peaks = 0, -math.inf, -1, []
    for r, curve in enumerate(curves):
        over_area, peak, peak_at = 0.0, 0.0, -1
        above = 1e-9  # a new peak is above the last by more than this: peak + 1e-9 max(|peak|, 1)
        cap, last = room[r], len(curve) - 1
        for k, (t, live, _) in enumerate(curve):
            if live > above:
                peak, peak_at = live, k
                above = peak + 1e-9 * max(abs(peak), 1.0)
            if k < last and live > cap:
                over_area += (live - cap) * (curve[k + 1][0] - t)
        peaks.append(peak)
        area += over_area
        peak_over += max(0.0, peak - room[r])
        if peak - room[r] > worst_over:
            worst, worst_over, worst_at = r, peak - room[r], peak_at
    # the keys live at the peak: replay the worst rank's changes up to it
    live_keys: dict = {}
    prev = 0.0
    for _, live, key in curves[worst][: worst_at + 1]:
        live_keys[key] = live_keys.get(key, 0.0) + (live - prev)
        prev = live
    at_peak = tuple(sorted(k for k, v in live_keys.items() if v > 1e-9))
    return _Fit(area, peak_over, worst, at_peak), peaks


def device_bytes(
    sim: Simulation,
    figures: StageFigures,
    layout: str,
    *,
    values: Sequence[float] | None = None,
    packed_everywhere: bool = True,
) -> DeviceBytes:
    """Each rank's bytes and each device's under `layout`, as the layout's lowering's byte
    model counts them (`jpipe.lower.interface.LoweringKind.byte_model`; module docstring).

    `figures` must be for the simulated schedule's stages
    (`StageFigures.for_schedule`). `values`, when known, is each rank's peak
    of live values (the search passes what it computed already).
    `packed_everywhere`: under the per-rank layout, whether the ranks share
    one mesh (each holds the packed parameters of every rank, as the search's
    pipelines do) or each has its own (`train.py`'s per-rank lowering).
    """
    ranks = _rank_figures(sim.schedule, figures)
    return _device_bytes(sim, figures, layout, values, ranks, packed_everywhere)


def _device_bytes(sim, figures, layout, values, ranks, packed_everywhere=True) -> DeviceBytes:
    """`device_bytes`, with `_rank_figures` at hand."""
    schedule = sim.schedule
    # Working memory per kind of piece matters only where a device holds its own rank's
    # working memory while a piece runs (the per-rank lowering), not a buffer sized once.
    per_piece = (
        figures.working_by_kind is not None and not layout_kind(layout).every_device_holds_busiest
    )
    busy = ()
    if per_piece:  # one walk of the events gives the live values' peaks too
        busy, peaks = _busy(sim, figures)
        values = peaks if values is None else values
    if values is None:
        values = [max((live for _, live, _ in c), default=0.0) for c in _curves(sim, figures)]
    values = tuple(max(0.0, v) for v in values)
    model = layout_kind(layout).byte_model()
    size = figures.sizes.table(schedule.num_stages)
    buffers = model.buffers(schedule, size["activation"], size["carry"])
    held = model.device_bytes(_need(ranks, values, buffers, busy, packed_everywhere))
    working = tuple(h.working for h in held) if per_piece else tuple(ranks[2])
    return DeviceBytes(
        layout, tuple(h.params for h in held), values, working,
        tuple(h.total for h in held), max(h.grad_output for h in held), buffers, held,
    )  # fmt: skip


def spmd_buffers(schedule: Schedule, figures: StageFigures) -> tuple[float, float]:
    """The SPMD program's residual and carry buffers, in bytes, as it sizes them from its
    tick plan (`jpipe.lower.spmd.bytes.tick_buffers`), for `figures`' stages."""
    from jpipe.lower.spmd.bytes import tick_buffers  # its tick plan: imported when asked

    table = figures.sizes.table(schedule.num_stages)
    return tick_buffers(schedule, table["activation"], table["carry"])


# -- candidates ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One schedule the search simulated.

    Attributes:
      spec: how to build it: a SPEC (``1f1b_recompute:k=2``, with ``chunks``)
        for a built-in, or the SPEC it started from and what the local search
        added (then only `schedule` builds it: save it with ``--csv``).
      schedule: the schedule.
      chunks: stages per rank.
      microbatches: M.
      simulation: its simulation with the figures' costs.
      memory: its bytes (`DeviceBytes`).
      fits: whether every device's bytes are within the budget.
      builtin: whether it is a built-in as the registry makes it (not changed
        by the local search).
      moves: what the local search added, as text (empty for a built-in).
    """

    spec: str
    schedule: Schedule
    chunks: int
    microbatches: int
    simulation: Simulation = dataclasses.field(repr=False)
    memory: DeviceBytes
    fits: bool
    builtin: bool = True
    moves: tuple[str, ...] = ()

    @property
    def time(self) -> float:
        return self.simulation.makespan

    @functools.cached_property  # counted once (the ranking reads them again and again)
    def memory_actions(self) -> int:
        """Its memory actions (recomputes, evictions, offloads and their ways back)."""
        return sum(a.is_memory for _, _, a in self.schedule.all_actions())

    @functools.cached_property
    def num_actions(self) -> int:
        return sum(1 for _ in self.schedule.all_actions())

    @property
    def label(self) -> str:
        chunks = f" (V={self.chunks})" if self.chunks > 1 else ""
        return f"{self.spec}{chunks}, M={self.microbatches}"

    def to_json(self) -> dict:
        return {
            "spec": self.spec,
            "chunks": self.chunks,
            "microbatches": self.microbatches,
            "builtin": self.builtin,
            "moves": list(self.moves),
            "time": self.time,
            "bubble_fraction": self.simulation.bubble_fraction,
            "fits": self.fits,
            "device_bytes": list(self.memory.device),
            "memory": self.memory.to_json(),
            "memory_actions": self.memory_actions,
        }


def spec_text(name: str, options: dict) -> str:
    return name + (":" + ",".join(f"{k}={v!r}" for k, v in options.items()) if options else "")


def builtin_specs(num_ranks: int, num_microbatches: int) -> list[tuple[str, int]]:
    """Every ``(SPEC, chunks)`` of `BUILTINS` for R ranks and M microbatches."""
    out = []
    for name, chunk_counts, grid in BUILTINS:
        combos = [{}]
        for key, values in grid.items():
            values = values(num_ranks, num_microbatches) if callable(values) else values
            combos = [{**c, key: v} for c in combos for v in values]
        for chunks in chunk_counts:
            for options in combos:
                out.append((spec_text(name, options), chunks))
    return out


# -- the local search over memory actions ---------------------------------------------------


@dataclasses.dataclass(frozen=True, order=True)
class Move:
    """Where one (stage, microbatch)'s residuals wait between their maker and their reader.

    Attributes:
      kind: ``"recompute"`` (its forward keeps only the input; a RECOMPUTE
        `lead` compute actions before the reader rebuilds them), ``"evict"``
        (to rank `partner` and back) or ``"offload"`` (to the host and back).
      stage, microbatch: the pair.
      lead: compute actions between a RECOMPUTE and the reader (0 or 1).
      partner: the rank an eviction goes to.
      after_input_grad: an eviction or offload over the wait from the I to
        the W (split backward) instead of from the F to the first reader.
    """

    kind: str
    stage: int
    microbatch: int
    lead: int = 0
    partner: int = -1
    after_input_grad: bool = False

    def __str__(self) -> str:
        where = f"({self.stage},{self.microbatch})"
        if self.kind == "recompute":
            return f"recompute {where}" + (f" {self.lead} action ahead" if self.lead else "")
        gap = " between I and W" if self.after_input_grad else ""
        to = f" to rank {self.partner}" if self.kind == "evict" else " to the host"
        return f"{self.kind} {where}{to}{gap}"


def _positions(row: Sequence[Action]) -> dict:
    return {(a.kind, a.stage, a.microbatch): i for i, a in enumerate(row)}


def _span(row, at, move: Move):
    """`(maker, reader)` indices in `row` of the wait `move` acts over, or None if too short.

    A recompute needs one compute action between the forward and the reader
    (else it frees nothing); a transfer three (one to hide the way out, one
    the way back, and one while nothing is on the device).
    """
    s, m = move.stage, move.microbatch
    f = at.get(("F", s, m))
    reader = at.get(("B", s, m), at.get(("I", s, m)))
    if f is None or reader is None:
        return None
    if move.kind == "recompute":
        return (f, reader) if reader - f >= 2 else None
    if move.after_input_grad:
        i, w = at.get(("I", s, m)), at.get(("W", s, m))
        if i is None or w is None:
            return None
        f, reader = i, w
    return (f, reader) if reader - f >= 3 else None


def apply_moves(base: Schedule, moves: Sequence[Move], name: str = "") -> Schedule:
    """`base` (compute actions only) with each move's memory actions inserted.

    Raises `ValueError` for a move whose pair has no room (`_span`).
    """
    return _apply_moves(base, _laid_out(base), moves, name)


def _laid_out(base: Schedule):
    """Each rank's plain actions of `base` and where each is (`_positions`): what
    `_apply_moves` and `_variants` read, once for a whole local search."""
    rows = tuple(base.actions(r) for r in range(base.num_ranks))
    return rows, tuple(_positions(row) for row in rows)


@functools.lru_cache(maxsize=1 << 16)
def _memory_action(kind: str, stage: int, microbatch: int, partner: int | None = None) -> Action:
    """One memory action, made once: actions are immutable, and the walk inserts the
    same ones into thousands of schedules."""
    return Action(kind, stage, microbatch, partner)


def _apply_moves(base: Schedule, laid_out, moves: Sequence[Move], name: str = "") -> Schedule:
    """`apply_moves`, with `base`'s rows and positions at hand (`_laid_out`)."""
    rows_of, positions = laid_out
    act = _memory_action
    by_rank: dict[int, list[Move]] = {}
    owner = base.stage_to_rank
    for mv in moves:
        by_rank.setdefault(owner[mv.stage], []).append(mv)
    rows = []
    for r in range(base.num_ranks):
        if r not in by_rank:
            rows.append(rows_of[r])
            continue
        row = list(rows_of[r])
        at = positions[r]
        before = [[] for _ in row]
        after = [[] for _ in row]
        for mv in by_rank[r]:
            span = _span(row, at, mv)
            if span is None:
                raise ValueError(f"{mv}: the wait is too short on rank {r}")
            maker, reader = span
            s, m = mv.stage, mv.microbatch
            if mv.kind == "recompute":
                row[maker] = act("FC", s, m)
                before[max(maker + 1, reader - mv.lead)].append(act("RECOMPUTE", s, m))
            elif mv.kind == "evict":
                after[maker].insert(0, act("EVICT", s, m, mv.partner))
                before[reader - 1].insert(0, act("LOAD", s, m, mv.partner))
            else:  # offload
                after[maker].insert(0, act("OFFLOAD_START", s, m))
                after[maker + 1].append(act("OFFLOAD_END", s, m))
                before[reader - 1].insert(0, act("RELOAD_START", s, m))
                before[reader].append(act("RELOAD_END", s, m))
        rows.append(tuple(x for i, a in enumerate(row) for x in (*before[i], a, *after[i])))
    # `Schedule(tuple(rows), name=...)`, without its check that every cell is an Action
    # (they are `base`'s or `_memory_action`'s). Moves add memory actions to pairs that
    # are there and turn an F into an FC, on the stage's own rank: the stages,
    # microbatches and placement are the base's, which the schedule (frozen) would
    # otherwise work out again from every action.
    out = object.__new__(Schedule)
    out.__dict__.update(
        ranks=tuple(rows), name=name or base.name, num_stages=base.num_stages,
        num_microbatches=base.num_microbatches, stage_to_rank=owner,
        stage_ranks=base.stage_ranks, replicated=base.replicated,
    )  # fmt: skip
    return out


def _variants(
    base: Schedule, key, allowed: set[str], current: Move | None, partners, laid_out=None
) -> list:
    """Every move for `key` the lowering runs, other than `current` (`laid_out`: `base`'s
    `_laid_out`, if at hand)."""
    s, m = key
    r = base.stage_to_rank[s]
    if laid_out is None:
        row = base.actions(r)
        at = _positions(row)
    else:
        row, at = laid_out[0][r], laid_out[1][r]
    out = []
    if "recompute" in allowed:
        out += [Move("recompute", s, m, lead=k) for k in (0, 1)]
    split = ("I", s, m) in at
    for gap in (False, True) if split else (False,):
        if "evict" in allowed:
            out += [Move("evict", s, m, partner=p, after_input_grad=gap) for p in partners(r)]
        if "offload" in allowed:
            out.append(Move("offload", s, m, after_input_grad=gap))
    return [mv for mv in out if mv != current and _span(row, at, mv) is not None]


# The memory actions of each kind of move.
MOVE_KINDS = {
    "recompute": ("FC", "RECOMPUTE"),
    "evict": ("EVICT", "LOAD"),
    "offload": ("OFFLOAD_START", "OFFLOAD_END", "RELOAD_START", "RELOAD_END"),
}


def _allowed_moves(layout: str, wanted=None) -> set[str]:
    """The kinds of move whose every action the layout's lowering runs (and in `wanted`)."""
    if wanted is not None:
        unknown = sorted(set(wanted) - set(MOVE_KINDS))
        if unknown:
            raise ValueError(f"memory actions {unknown} are not among {', '.join(MOVE_KINDS)}")
    return {
        move
        for move, kinds in MOVE_KINDS.items()
        if all(lowering_runs(layout, k) for k in kinds) and (wanted is None or move in wanted)
    }


class _Timeline(NamedTuple):
    """A schedule run in time with the figures' costs: what the walk reads of its
    `Simulation`, and the run itself (`timed`, `_timed`'s result), from which the
    schedule the walk ends with gets its `Simulation` without running again (None for
    a base, whose `Simulation` the built-ins made)."""

    schedule: Schedule
    starts: Sequence
    ends: Sequence
    makespan: float
    timed: tuple | None = None


class _Evaluator:
    """Simulates schedules against the figures and the budget, counting them (up to `limit`)."""

    def __init__(self, figures: StageFigures, budget: float, layout: str, limit=math.inf):
        self.figures, self.budget, self.layout = figures, budget, layout
        # whether the layout's devices hold other than each rank's own bytes (SPMD)
        self.own = layout_kind(layout).byte_model() is layout_kind(OWN).byte_model()
        self.count, self.limit = 0, limit
        self._allowed: dict = {}  # placement of the stages -> what `_allowances` reads, and it

    @property
    def exhausted(self) -> bool:
        return self.count >= self.limit

    def __call__(self, schedule: Schedule, simulation: Simulation | None = None):
        """`(timeline, fit, DeviceBytes)`, or None if `schedule` does not validate.

        `simulation`, if given, is `schedule`'s with the figures' costs (the base's,
        simulated as a built-in), read instead of running it again.

        The bytes are each rank's own (``"mpmd"``), which is what picks a
        roomy partner and costs no tick plan; `bytes_of` gives the layout's.
        Under another layout (``"spmd"``) a schedule whose simulated values fit
        is checked against the bytes the layout's model counts (the SPMD
        program's tick buffers can hold more than the simulated peak); where
        those do not fit, every rank's room shrinks by the difference, so the
        walk goes on from the fullest rank.
        """
        try:
            analyze(schedule)
        except ScheduleError:
            return None
        self.count += 1
        if simulation is None:
            timed = _timed(schedule, self.figures.costs)
            sim = _Timeline(schedule, timed[0], timed[1], timed[4], timed)
        else:
            sim = _Timeline(schedule, simulation.starts, simulation.ends, simulation.makespan)
        placement = schedule.stage_to_rank
        if placement not in self._allowed:  # memory moves leave it as the base's
            ranks = _rank_figures(schedule, self.figures)
            self._allowed[placement] = (
                ranks,
                _allowances(schedule, self.figures, self.layout, self.budget, ranks)[2],
            )
        ranks, room = self._allowed[placement]
        curves = _curves(sim, self.figures)  # once: the layout's check below reads them again
        fit, peaks = _fit(curves, room)
        if not self.own and fit.fits:
            held = _device_bytes(sim, self.figures, self.layout, peaks, ranks)  # its ticks
            over = held.most - self.budget
            if over > 0:
                extra = max(over, max(h.values for h in held.held) - max(peaks))
                fit, peaks = _fit(curves, [r - extra for r in room])
        return sim, fit, _device_bytes(sim, self.figures, OWN, peaks, ranks)

    def bytes_of(self, found) -> DeviceBytes:
        """The layout's `DeviceBytes` of an evaluated schedule (the SPMD one plans its ticks)."""
        sim, _, own = found
        if self.own:
            return own
        return device_bytes(sim, self.figures, self.layout, values=own.values)


class LocalSearch(NamedTuple):
    """What `local_search` found: a schedule that fits, or None, and the effort."""

    schedule: Schedule | None
    moves: tuple[Move, ...]
    simulation: Simulation | None
    memory: DeviceBytes | None
    simulated: int


def local_search(
    base: Schedule,
    figures: StageFigures,
    budget: float,
    layout: str,
    *,
    deadline: float = math.inf,
    max_simulations: float = math.inf,
    log: Callable[[str], None] | None = None,
    memory_actions: Sequence[str] | None = None,
    base_simulation: Simulation | None = None,
) -> LocalSearch:
    """Memory actions for `base` until it fits `budget` at the least added time (module
    docstring); `LocalSearch.schedule` is None if it found no way to fit.

    `figures` are `base`'s (`StageFigures.for_schedule`); `base` has no memory
    actions and no overlapped cells; `budget` is what a device may hold.
    `base_simulation`, if given, is `base`'s with `figures.costs`, read instead of
    running it again.
    """
    evaluate = _Evaluator(figures, budget, layout, max_simulations)
    allowed = _allowed_moves(layout, memory_actions)
    found = _local_search(base, evaluate, allowed, deadline, log, base_simulation)
    if found is None:
        return LocalSearch(None, (), None, None, evaluate.count)
    schedule, moves, current = found
    timeline = current[0]
    if getattr(timeline, "timed", None) is not None:  # run once, in the walk
        current = (_simulation(schedule, figures.costs, timeline.timed), *current[1:])
    elif not isinstance(timeline, Simulation):  # the walk keeps less of one met again
        current = (simulate(schedule, figures.costs), *current[1:])
    return LocalSearch(schedule, moves, current[0], evaluate.bytes_of(current), evaluate.count)


# `sorted(moves)` of the walk's moves, each of a different (stage, microbatch): `Move`'s
# own order (its fields in turn), which these first three fields already decide.
_MOVE_ORDER = operator.attrgetter("kind", "stage", "microbatch")


class _Seen(NamedTuple):
    """What the walk keeps of a schedule it evaluated, to meet it again: its simulated step
    (a `Simulation`'s `makespan`, all the walk reads of one)."""

    makespan: float


def _local_search(base, evaluate, allowed, deadline, log, base_simulation=None):
    """A walk over memory actions on `base` until it fits: ``(schedule, moves, figures)``,
    or None where it gives up (out of time or simulations, no progress at the peak, or
    nothing left that frees bytes on the fullest device).

    Each step tries the moves on the pairs live at the fullest device's peak
    (`_step_trials`) and takes the one that frees the most per second it costs
    (`_choose_step`), or, where none frees anything, the least bad one as a short tabu
    walk. Once it fits, moves not needed are taken back and each is tried as another
    (`_polish`). `evaluate(schedule[, simulation])` gives ``(timeline, fit, bytes)``.
    """
    if not allowed:
        return None
    R = base.num_ranks
    moves: dict[tuple[int, int], Move] = {}
    laid_out = _laid_out(base)

    def build(ordered):
        try:
            return _apply_moves(base, laid_out, ordered, name=f"{base.name}+search")
        except ValueError:
            return None

    # The walk meets some sets of moves again (a pass that takes moves back tries what the
    # pass before tried, and a step what the step before did): each set is built and
    # evaluated once. Met again, it counts as simulated again, so that the bound on
    # simulations and the count reported are what they were when each was simulated anew.
    seen: dict[tuple[Move, ...], tuple | None] = {}

    def run(ms):
        key = tuple(sorted(ms.values(), key=_MOVE_ORDER))
        if key in seen:
            got = seen[key]
            if got is not None:
                evaluate.count += 1
            return got
        if not key and base_simulation is not None:  # the base, as the built-ins ran it
            got = evaluate(base, base_simulation)
        else:
            schedule = build(key)
            got = None if schedule is None else evaluate(schedule)
        seen[key] = None if got is None else (_Seen(got[0].makespan), *got[1:])
        return got

    current = run(moves)
    if current is None:
        return None

    def variants(figures, key, now=None):
        """The moves of `key` other than `now`, with the partners as `figures` leave them."""

        def partners(r):
            # BPipe's partner, and the rank whose device has the most room now
            mem = figures[2]
            others = (q for q in range(R) if q != r)
            roomiest = min(others, key=lambda q: mem.device[q], default=None)
            return sorted({q for q in (R - 1 - r, roomiest) if q is not None and q != r})

        return _variants(base, key, allowed, now, partners, laid_out)

    tau = 0.01 * current[0].makespan  # so that a free move is worth far more than a costly one
    steps = stalls = 0
    recent: list = []  # pairs changed by the last non-improving steps: not changed again soon
    # Give up when the bytes over the budget at the peak have not fallen for this many steps:
    # on GPT-2 small's searches those that fit went at most 5 steps without, those that
    # failed 13 to 24.
    patience = base.num_stages + R
    lowest, since = math.inf, 0
    while not current[1].fits:
        if time.perf_counter() > deadline or evaluate.exhausted:
            return None
        fit = current[1]
        if fit.peak_over < lowest * (1 - 1e-9):
            lowest, since = fit.peak_over, 0
        elif (since := since + 1) > patience:
            return None
        trials = _step_trials(base, fit, moves, functools.partial(variants, current))
        best, least_bad = _choose_step(trials, run, fit, current, tau, recent)
        if best is not None:
            moves, current = best[1], best[2]
        elif least_bad is not None and stalls < 2 * base.num_ranks:
            # Nothing on the fullest device frees bytes by itself: take the change that
            # costs least and keep its pairs from being changed back for a while (a short
            # tabu walk), so that the next step can find what frees them.
            moves, current = least_bad[1], least_bad[2]
            recent = (recent + sorted(least_bad[3]))[-4:]
            stalls += 1
        else:
            return None  # nothing left to move frees anything on the fullest device
        steps += 1
        if log and steps % 10 == 0:
            log(
                f"    {base.name}: {len(moves)} pairs moved, "
                f"{format_bytes(current[1].peak_over)} over, step {current[0].makespan:.4g}"
            )
    moves, current = _polish(moves, current, run, variants, deadline, evaluate)
    ordered = tuple(sorted(moves.values(), key=_MOVE_ORDER))
    if ordered and isinstance(current[0], _Timeline):  # built in the walk: validated once
        return current[0].schedule, ordered, current
    return build(ordered), ordered, current


def _step_trials(base, fit, moves, variants) -> list[tuple[set, dict]]:
    """The local search's candidate steps from `moves`: ``(pairs changed, moves)``;
    `variants(key[, now])` gives a pair's moves.

    Each move on a pair live at the fullest device's peak (of that device's
    stages, or moved already), and the same move for every microbatch of a
    stage at once (1F1B's plateaus: its first rank holds R microbatches through
    the whole steady state), to the pairs not moved yet and to all of them.
    """
    trials = []
    keys = [k for k in fit.at_peak if base.stage_to_rank[k[0]] == fit.fullest or k in moves]
    keys = keys or list(fit.at_peak)
    for key in keys:
        for mv in variants(key, moves.get(key)):
            trials.append(({key}, {**moves, key: mv}))
    for s in sorted({k[0] for k in keys}):
        shapes = {
            dataclasses.replace(mv, microbatch=0) for k in keys if k[0] == s for mv in variants(k)
        }
        for shape in sorted(shapes):
            fill, every = dict(moves), dict(moves)
            for m in range(base.num_microbatches):
                mv = dataclasses.replace(shape, microbatch=m)
                if mv in variants((s, m)):
                    every[(s, m)] = mv
                    if (s, m) not in moves:
                        fill[(s, m)] = mv
            if len(fill) > len(moves) + 1:
                trials.append((set(fill) - set(moves), fill))
            changed = {k for k in every if every[k] != moves.get(k)}
            if every != fill and len(changed) > 1:
                trials.append((changed, every))
    return trials


def _choose_step(trials, run, fit, current, tau, recent):
    """``(best, least_bad)`` of the evaluated `trials`: the one that frees the most bytes
    (area over the budget, then peak over it) per second it adds, as ``(score, moves,
    figures)``; and, among those that free nothing and change no pair in `recent`, the
    one least over, as ``(rank, moves, figures, pairs changed)``. Either may be None."""
    best = least_bad = None
    for changed, trial in trials:
        got = run(trial)
        if got is None:
            continue
        sim, new, _ = got
        gain = (fit.area - new.area, fit.peak_over - new.peak_over)
        if gain[0] > 0 or (gain[0] == 0 and gain[1] > 0):
            cost = max(0.0, sim.makespan - current[0].makespan) + tau
            score = (gain[0] / cost, gain[1] / cost)
            if best is None or score > best[0]:
                best = (score, trial, got)
        elif not changed & set(recent):
            rank = (new.peak_over, new.area, sim.makespan)
            if least_bad is None or rank < least_bad[0]:
                least_bad = (rank, trial, got, changed)
    return best, least_bad


def _polish(moves, current, run, variants, deadline, evaluate):
    """Once the moves fit: each taken back where the step is no longer without it, then
    each tried as another kind or placement (a recompute as a transfer, a transfer taken
    early as a recompute that costs less) where that is faster; until nothing changes.
    ``(moves, figures)``. `variants(figures, key, now)` as `_local_search`'s."""
    improved = True
    while improved and time.perf_counter() <= deadline and not evaluate.exhausted:
        improved = False
        order = sorted(moves, key=lambda k: (moves[k].kind != "recompute", k))
        for key in order:
            trial = {k: v for k, v in moves.items() if k != key}
            got = run(trial)
            if got is not None and got[1].fits and got[0].makespan <= current[0].makespan:
                moves, current, improved = trial, got, True
        for key in list(moves):
            for mv in variants(current, key, moves[key]):
                trial = {**moves, key: mv}
                got = run(trial)
                if got is not None and got[1].fits and got[0].makespan < current[0].makespan:
                    moves, current, improved = trial, got, True
                    break
    return moves, current


# -- the search ----------------------------------------------------------------------------


def rank_candidates(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The candidates fastest first; those whose simulated steps tie, simplest first.

    Steps within `TIE` of each other (relative) tie. Among them the one with
    fewer memory actions comes first, then the one with fewer actions in
    all, then the one with fewer bytes on its fullest device, then a
    built-in: a memory action that does not shorten the step is only traffic
    and a chance to go wrong (ZB-H1 with 120 offloads ties plain ZB-H1 when
    the host link hides every copy; ZB-H1 wins). Bytes come after actions
    because a candidate either fits the budget or not, and both fit here.
    """
    ordered = sorted(candidates, key=lambda c: c.time)
    out, group = [], []

    def flush():
        group.sort(key=lambda c: (c.memory_actions, c.num_actions, c.memory.most, not c.builtin,
                                  c.time))  # fmt: skip
        out.extend(group)
        group.clear()

    for c in ordered:
        if group and c.time > group[0].time + TIE * max(abs(group[0].time), 1e-300):
            flush()
        group.append(c)
    flush()
    return out


@dataclasses.dataclass(frozen=True)
class ScheduleSearch:
    """What `search_schedule` found.

    Attributes:
      winner: the fastest candidate that fits, or None.
      best_builtin: the fastest built-in (unchanged by the local search) that fits.
      candidates: every candidate simulated, fastest first.
      skipped: why some SPECs gave no candidate (one line each).
      budget: bytes per device.
      margin: the share of `budget` kept free; a candidate fits within `usable`.
      layout: ``"spmd"`` or ``"mpmd"``; `lowering` the Pipeline lowering it stands for.
      memory_moves: the kinds of memory action the lowering runs (`lowering_runs`).
      simulated: schedules simulated, the local search's included.
      seconds: how long the search took.
    """

    winner: Candidate | None
    best_builtin: Candidate | None
    candidates: tuple[Candidate, ...]
    skipped: tuple[str, ...]
    budget: float
    layout: str
    memory_moves: tuple[str, ...]
    simulated: int
    seconds: float
    margin: float = 0.0

    @property
    def lowering(self) -> str:
        return layout_kind(self.layout).name

    @property
    def usable(self) -> float:
        """What a device may hold: the budget less the margin."""
        return self.budget * (1 - self.margin)

    def reasons(self) -> list[str]:
        """Why the winner won, in lines (see `search_schedule`); bytes in units that suit
        them (`format_bytes`)."""
        b = format_bytes
        out = []
        w = self.winner
        of = f"{b(self.budget)}" + (
            f" ({b(self.usable)} with the {self.margin:.0%} margin)" if self.margin else ""
        )
        if w is None:
            fullest = min(self.candidates, key=lambda c: c.memory.most, default=None)
            out.append(f"nothing fits {of} per device ({self.layout} layout)")
            if fullest is not None:
                out.append(f"the least memory: {fullest.label} with {b(fullest.memory.most)}")
            return out
        out.append(
            f"winner: {w.label}: simulated step {w.time:.4g}, {b(w.memory.most)} on the "
            f"fullest device (rank {w.memory.fullest}) of {of}, "
            f"{self.layout} layout (lowering={self.lowering!r})"
        )
        parts = ", ".join(f"{k} {b(v)}" for k, v in w.memory.parts(w.memory.fullest).items())
        out.append(f"  fullest device: {parts}")
        if w.moves:
            kinds = {}
            for mv in w.moves:
                kinds[mv.split(" (")[0]] = kinds.get(mv.split(" (")[0], 0) + 1
            pairs = w.schedule.num_stages * w.microbatches
            out.append(
                f"  the local search moved {len(w.moves)} of the {pairs} (stage, microbatch) "
                f"pairs of {w.spec.split(' + ')[0]}: "
                + ", ".join(f"{n} by {k}" for k, n in sorted(kinds.items()))
            )
        faster = [c for c in self.candidates if c.time < w.time and not c.fits]
        if faster:
            shown = ", ".join(f"{c.label} ({c.time:.4g}, {b(c.memory.most)})" for c in faster[:4])
            more = f" and {len(faster) - 4} more" if len(faster) > 4 else ""
            out.append(f"  faster but over the budget: {shown}{more}")
        else:
            out.append("  no candidate is faster, whatever its memory")
        fitting = [c for c in self.candidates if c.fits and c is not w]
        if fitting:
            nxt = fitting[0]
            out.append(
                f"  next that fits: {nxt.label} at {nxt.time:.4g} "
                f"({(nxt.time / w.time - 1) * 100:+.1f}%), {b(nxt.memory.most)}"
            )
        bb = self.best_builtin
        if bb is not None and bb is not w:
            out.append(
                f"best built-in that fits: {bb.label} at {bb.time:.4g} "
                f"({(bb.time / w.time - 1) * 100:+.1f}% against the winner), {b(bb.memory.most)}"
            )
        elif bb is w:
            out.append("  it is itself the best built-in that fits")
        return out

    def to_json(self) -> dict:
        return {
            "budget_bytes": self.budget,
            "margin": self.margin,
            "usable_bytes": self.usable,
            "layout": self.layout,
            "lowering": self.lowering,
            "memory_moves": list(self.memory_moves),
            "winner": None if self.winner is None else self.winner.to_json(),
            "best_builtin": None if self.best_builtin is None else self.best_builtin.to_json(),
            "candidates": [c.to_json() for c in self.candidates],
            "skipped": list(self.skipped),
            "simulated": self.simulated,
            "seconds": self.seconds,
            "why": self.reasons(),
        }


def _build(spec, num_ranks: int, M: int, chunks, built: dict | None) -> Schedule:
    """`get_schedule(spec, num_ranks, M, chunks)`, kept in `built` (and its refusal)."""
    if built is None:
        return get_schedule(spec, num_ranks, M, chunks)
    key = (spec, num_ranks, M, chunks)
    if key not in built:
        try:
            built[key] = get_schedule(spec, num_ranks, M, chunks)
        except ValueError as e:
            built[key] = ValueError(str(e))
    got = built[key]
    if isinstance(got, ValueError):
        raise ValueError(str(got))
    return got


def search_schedule(
    figures: StageFigures | StageProfile,
    num_ranks: int,
    microbatches: int | Sequence[int],
    budget: float,
    *,
    layout: str = "spmd",
    schedules: Sequence[str | tuple[str, int]] | None = None,
    local: bool = True,
    batch: int | None = None,
    margin: float = MARGIN,
    memory_actions: Sequence[str] | None = None,
    max_simulations: int = 20_000,
    max_seconds: float | None = None,
    log: Callable[[str], None] | None = None,
    built: dict | None = None,
) -> ScheduleSearch:
    """The fastest schedule whose simulated bytes per device fit `budget` (module docstring).

    Args:
      figures: each stage's costs and bytes per microbatch (`StageFigures`),
        or a `StageProfile` with figures for several splits.
      num_ranks: R.
      microbatches: M, or several to try.
      budget: bytes per device.
      layout: ``"spmd"`` (every device holds the largest rank's terms; the
        SPMD lowering) or ``"mpmd"`` (each its own; ``lowering="mpmd"``).
      schedules: SPECs to try instead of every built-in (`builtin_specs`),
        each a string (its default chunks) or ``(SPEC, chunks)``.
      local: also run the local search over memory actions where the
        lowering runs them.
      batch: sequences per step. With it, the figures are taken as for
        microbatches of ``figures.microbatch_size`` sequences (a
        `StageProfile`'s; for plain `StageFigures`, ``batch / M`` of the
        first M) and each M gets them scaled to ``batch / M`` sequences
        (linearly; parameters unscaled). Without it, every M uses the
        figures as given (microbatches of a fixed size).
      margin: the share of `budget` kept free (`MARGIN`): a candidate fits
        when every device's bytes are within ``budget * (1 - margin)``.
      memory_actions: the kinds of memory action allowed (``"recompute"``,
        ``"evict"``, ``"offload"``; `MOVE_KINDS`), in the built-ins and the
        local search alike; default every kind the lowering runs.
      max_simulations: a bound on the schedules the local search simulates,
        all bases together (the built-ins are always all simulated); a base
        left without any is skipped, saying so. A count, so that the result
        does not depend on the machine's load.
      max_seconds: a bound on the local search's time as well, if given (the
        result then depends on the machine's speed).
      log: called with a line of progress now and then.
      built: a dict the caller keeps between searches (the planner's, one a shape): each
        schedule built for a SPEC, ranks, microbatches and chunks, used again, with what
        was worked out on it (`jpipe.validate`'s analysis, the SPMD program's lifetimes).
    """
    start = time.perf_counter()
    Ms = _check_search_arguments(layout, num_ranks, microbatches, budget, margin, batch)
    memory_moves = tuple(sorted(_allowed_moves(layout, memory_actions)))
    terms = _SearchTerms(num_ranks, layout, budget * (1 - margin), memory_moves)
    candidates, skipped, bases = _builtin_candidates(figures, Ms, batch, schedules, terms, built)
    simulated = len(candidates)  # one simulation each
    if log:
        fitting = sum(c.fits for c in candidates)
        log(f"  {len(candidates)} built-in candidates simulated, {fitting} fit")
    if local and memory_moves:
        deadline = math.inf if max_seconds is None else start + max_seconds
        simulated += _local_candidates(
            bases, candidates, skipped, terms, max_simulations, deadline, log
        )
    candidates = rank_candidates(candidates)
    fitting = [c for c in candidates if c.fits]
    return ScheduleSearch(
        winner=fitting[0] if fitting else None,
        best_builtin=next((c for c in fitting if c.builtin), None),
        candidates=tuple(candidates),
        skipped=tuple(skipped),
        budget=float(budget),
        layout=layout,
        memory_moves=memory_moves,
        simulated=simulated,
        seconds=time.perf_counter() - start,
        margin=float(margin),
    )


@dataclasses.dataclass(frozen=True)
class _SearchTerms:
    """What every candidate of one `search_schedule` is held to.

    Attributes:
      num_ranks: R.
      layout: ``"spmd"`` or ``"mpmd"`` (`LAYOUTS`).
      usable: the bytes a device may hold: the budget less the margin.
      memory_moves: the kinds of memory action allowed (`MOVE_KINDS`' keys), sorted.
    """

    num_ranks: int
    layout: str
    usable: float
    memory_moves: tuple[str, ...]

    @property
    def allowed_kinds(self) -> set[str]:
        """The action kinds of the memory actions allowed."""
        return {k for move in self.memory_moves for k in MOVE_KINDS[move]}


def _check_search_arguments(
    layout: str, num_ranks, microbatches, budget, margin, batch: int | None
) -> list[int]:
    """`search_schedule`'s microbatch counts M as a list; raises `ValueError` for a layout,
    R, M, budget or margin it cannot take, or for a `batch` some M does not divide."""
    layout_kind(layout)
    if not (isinstance(num_ranks, int) and num_ranks >= 1):
        raise ValueError(f"the number of ranks must be a positive integer, got {num_ranks!r}")
    Ms = [microbatches] if isinstance(microbatches, int) else list(microbatches)
    if not Ms or any(not isinstance(m, int) or m < 1 for m in Ms):
        raise ValueError(f"microbatch counts must be positive integers, got {microbatches!r}")
    if not budget > 0:
        raise ValueError(f"the budget must be a positive number of bytes, got {budget!r}")
    if not 0 <= margin < 1:
        raise ValueError(f"the margin must be in [0, 1), got {margin!r}")
    if batch is not None:
        for m in Ms:
            if batch % m:
                raise ValueError(
                    f"{m} microbatches do not divide the batch of {batch} sequences; "
                    f"M must divide it"
                )
    return Ms


def _builtin_candidates(figures, Ms, batch, schedules, terms: _SearchTerms, built):
    """Every SPEC (`schedules`, or `builtin_specs`) for every M, each simulated once:
    ``(candidates, skipped, bases)``, the candidates in the order tried, a line for each
    SPEC that gave none (and why), and the bases of the local search (`_is_plain`), each
    with the figures it ran on. With `batch`, each M gets the figures scaled to its
    microbatch size (see `search_schedule`)."""
    if batch is not None:
        reference = getattr(figures, "microbatch_size", None) or batch // Ms[0]
    candidates: list[Candidate] = []
    skipped: list[str] = []
    bases: list[tuple[Candidate, StageFigures]] = []
    for M in Ms:
        scaled = figures
        if batch is not None and batch // M != reference:
            scaled = figures.scaled((batch // M) / reference, params=False)
        specs = builtin_specs(terms.num_ranks, M) if schedules is None else schedules
        for item in specs:
            spec, chunks = (item, None) if isinstance(item, str) else item
            try:
                schedule = _build(spec, terms.num_ranks, M, chunks, built)
                fig = scaled.for_schedule(schedule)
            except ValueError as e:
                skipped.append(f"{spec}{f' (V={chunks})' if chunks else ''}, M={M}: {e}")
                continue
            why_not = _why_no_candidate(spec, M, schedule, terms)
            if why_not:
                skipped.append(why_not)
                continue
            cand = _simulated(spec, M, schedule, fig, terms)
            candidates.append(cand)
            if _is_plain(schedule):
                bases.append((cand, fig))
    return candidates, skipped, bases


def _why_no_candidate(spec, M: int, schedule: Schedule, terms: _SearchTerms) -> str | None:
    """Why `schedule`, built for `spec` and `M` microbatches, is no candidate (a line for
    `ScheduleSearch.skipped`), or None: it has other ranks or microbatches than asked,
    the layout's lowering does not run its memory actions, or they are not allowed."""
    if schedule.num_ranks != terms.num_ranks or schedule.num_microbatches != M:
        return (
            f"{spec}, M={M}: it has {schedule.num_ranks} ranks and "
            f"{schedule.num_microbatches} microbatches"
        )
    if not runs_schedule(terms.layout, schedule):
        kinds = sorted({a.kind for _, _, a in schedule.all_actions() if a.is_memory})
        return (
            f"{spec}, M={M}: the {layout_kind(terms.layout).name} lowering does not run its "
            f"memory actions ({', '.join(kinds)}); layout mpmd would take it"
        )
    kinds = {a.kind for _, _, a in schedule.all_actions() if a.is_memory}
    if not kinds <= terms.allowed_kinds:
        return (
            f"{spec}, M={M}: its memory actions ({', '.join(sorted(kinds))}) are not "
            f"among those allowed ({', '.join(terms.memory_moves) or 'none'})"
        )
    return None


def _simulated(spec, M: int, schedule: Schedule, fig: StageFigures, terms: _SearchTerms):
    """`schedule` as a `Candidate`: simulated on `fig`'s costs, its bytes per device under
    the layout, whether they fit."""
    sim = simulate(schedule, fig.costs)
    memory = device_bytes(sim, fig, terms.layout)
    V = schedule.num_stages // max(terms.num_ranks, 1)
    return Candidate(
        spec=spec, schedule=schedule, chunks=V, microbatches=M, simulation=sim,
        memory=memory, fits=memory.most <= terms.usable,
    )  # fmt: skip


def _is_plain(schedule: Schedule) -> bool:
    """Whether `schedule` has no memory actions and no overlapped steps: a base the local
    search may add memory actions to."""
    return not schedule.has_memory_actions and not any(
        isinstance(step, Overlap) for row in schedule.ranks for step in row
    )


def _local_candidates(
    bases, candidates: list[Candidate], skipped: list[str], terms: _SearchTerms,
    max_simulations: int, deadline: float, log,
) -> int:  # fmt: skip
    """The local search over memory actions on each base, fastest first, that is faster
    than the best candidate that fits but does not fit itself: adds what it finds to
    `candidates` (so that a later base must beat it) and a line for each base that gave
    nothing to `skipped`. Returns the schedules it simulated, at most `max_simulations`."""
    usable = terms.usable
    simulated = 0
    for cand, fig in sorted(bases, key=lambda x: x[0].time):
        best = min((c.time for c in candidates if c.fits), default=math.inf)
        if cand.fits or cand.time >= best:
            continue  # memory actions never make a step shorter
        _, _, room = _allowances(cand.schedule, fig, terms.layout, usable)
        if min(room) < 0:  # no live value at all would fit beside them
            skipped.append(
                f"{cand.label}: no local search (a device's parameters, gradients and "
                f"working memory alone exceed the {usable:.4g} bytes it may use)"
            )
            continue
        left = max_simulations - simulated
        if time.perf_counter() > deadline or left <= 0:
            skipped.append(
                f"{cand.label}: no local search (past --max-simulations or --max-seconds)"
            )
            continue
        if log:
            log(f"  local search on {cand.label} ({format_bytes(cand.memory.most)})")
        found = local_search(
            cand.schedule, fig, usable, terms.layout, deadline=deadline, log=log,
            memory_actions=terms.memory_moves, max_simulations=left,
            base_simulation=cand.simulation,
        )  # fmt: skip
        simulated += found.simulated
        if found.schedule is None:
            skipped.append(f"{cand.label}: the local search found no placement that fits")
            continue
        schedule, moves, sim, memory = found[:4]
        candidates.append(
            Candidate(
                spec=f"{cand.spec} + {len(moves)} memory move{'s' if len(moves) > 1 else ''}",
                schedule=schedule,
                chunks=cand.chunks,
                microbatches=cand.microbatches,
                simulation=sim,
                memory=memory,
                fits=memory.most <= usable,
                builtin=False,
                moves=tuple(map(str, moves)),
            )
        )
    return simulated
