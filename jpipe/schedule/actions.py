"""The schedule as data: actions, per-rank lists, and PyTorch's CSV form.

A pipeline schedule is nothing but an ordered list of actions for each rank.
An action names a kind (``F`` forward, ``B`` full backward, ``I`` backward for
the input gradient only, ``W`` backward for the weight gradient only), a stage
and a microbatch. The stage-to-rank placement is whatever the lists say.

Everything here is plain, frozen and hashable, so a schedule can be printed,
compared, saved, and passed as a static argument to a jitted function. Nothing
here checks that a schedule makes sense; that is `jpipe.validate`'s job.

The CSV form is PyTorch's (``torch.distributed.pipelining``): one row per rank,
one action per cell written ``{stage}{kind}{microbatch}`` (``2F0``), blank cells
allowed, and compound cells ``(0F7;7B3)OVERLAP_F_B`` for a forward and a
backward run together on one rank. Older PyTorch files write an input-gradient
step as ``B`` when a ``W`` of the same stage and microbatch follows it on the
same rank; `Schedule.from_csv` reads such a ``B`` as the ``I`` it means.

PyTorch's runtime form (what its ``_dump_csv`` writes by default) also has
cells that are not compute: transfers ``{stage}SEND_F{microbatch}``,
``RECV_F``, ``SEND_B``, ``RECV_B``, FSDP's ``{stage}UNSHARD`` and
``{stage}RESHARD``, and ``{stage}REDUCE_GRAD`` after a stage's last backward.
jpipe makes its own transfers and reductions, so `Schedule.from_csv` reads
these and drops them, after checking that each names a stage its rank
computes (PyTorch writes them so); what remains is the compute order.

Memory actions (issue 23) say where a `(stage, microbatch)`'s residuals live
between its forward and the backward that reads them. PyTorch has none, so
their cells are jpipe's own, written in PyTorch's style (upper-case names
like ``SEND_F``, ``{stage}{KIND}{microbatch}``):

- ``2FC0`` (`FC`): a forward that keeps only its input; its residuals are
  rebuilt by ``2RECOMPUTE0`` (`RECOMPUTE`, the cost of a forward) before the
  stage's ``B`` or ``I``;
- ``2EVICT0@5`` (`EVICT`): the residuals go to partner rank 5;
  ``2LOAD0@5`` (`LOAD`) brings them back before they are read;
- ``2OFFLOAD_START0``, ``2OFFLOAD_END0`` (`OFFLOAD_START`, `OFFLOAD_END`):
  a copy to host memory, begun and then waited for (the device copy is
  freed at the end), so the work between the two can hide it;
  ``2RELOAD_START0``, ``2RELOAD_END0`` (`RELOAD_START`, `RELOAD_END`): the
  copy back, whose end the residuals' reader waits for.

A cell that is neither PyTorch's nor one of these is refused by name.

A stage may appear on several ranks (replicas, as in Chimera: each rank keeps
a copy of its parameters; `Schedule.stage_ranks`). The CSV writes such a
schedule as any other, but PyTorch's runtime places each stage on one rank,
so only jpipe reads it as meant.

Sizes are bounded (`check_size`): at most `MAX_RANKS` ranks and
`MAX_ACTIONS` actions, so that a typo such as 10^9 microbatches is refused
at once, naming the limit, instead of building lists for minutes. Building,
checking and simulating a schedule costs some microseconds per action on
one core, so the largest one allowed takes under a minute.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import io
import os
import re
from collections.abc import Iterable, Sequence

KINDS = ("F", "B", "I", "W")
BACKWARD_KINDS = ("B", "I")  # the kinds that pass a gradient upstream
# Memory actions (see the module docstring): where residuals live, not compute.
MEMORY_KINDS = (
    "FC",
    "RECOMPUTE",
    "EVICT",
    "LOAD",
    "OFFLOAD_START",
    "OFFLOAD_END",
    "RELOAD_START",
    "RELOAD_END",
)
ALL_KINDS = KINDS + MEMORY_KINDS
PARTNER_KINDS = ("EVICT", "LOAD")  # the kinds that name a partner rank
COMPUTE_KINDS = KINDS + ("FC", "RECOMPUTE")  # the kinds that occupy a rank's compute

_KIND_ALTERNATIVES = "|".join(sorted(ALL_KINDS, key=len, reverse=True))
_CELL_RE = re.compile(rf"^\s*(\d+)\s*({_KIND_ALTERNATIVES})\s*(\d+)\s*(?:@\s*(\d+)\s*)?$")
_OVERLAP_RE = re.compile(r"^\s*\((.+?);(.+?)\)\s*OVERLAP_F_B\s*$")
# PyTorch's cells that jpipe reads and drops (see the module docstring).
DROPPED_CSV_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD", "REDUCE_GRAD")
_DROPPED_RE = re.compile(rf"^\s*(\d+)\s*({'|'.join(DROPPED_CSV_KINDS)})\s*(\d*)\s*$")
_ANY_OVERLAP_RE = re.compile(r"^\s*\((.*)\)\s*OVERLAP_F_B\s*$")

# Sizes past which a schedule is refused (see the module docstring). A pipeline axis of
# 4096 ranks is far beyond any machine's; 2^22 actions is, for example, 8 ranks x
# 262,144 microbatches of 1F1B, or 512 ranks x 4096 microbatches.
MAX_RANKS = 4096
MAX_ACTIONS = 2**22


def check_size(num_ranks: int, num_microbatches: int, num_chunks: int = 1, what: str = "") -> None:
    """Refuses a schedule too large to build in reasonable time, naming the limit.

    A schedule of R ranks, V stages per rank and M microbatches has at least
    ``2 R V M`` actions (a forward and a backward of each stage on each
    microbatch); that must stay within `MAX_ACTIONS`, and R within `MAX_RANKS`.
    """
    where = f"{what}: " if what else ""
    if num_ranks > MAX_RANKS:
        raise ValueError(
            f"{where}{num_ranks} ranks is more than jpipe's limit of MAX_RANKS={MAX_RANKS} "
            "(jpipe.schedule.actions.MAX_RANKS); a pipeline axis that long is surely a typo"
        )
    actions = 2 * num_ranks * max(num_chunks, 1) * num_microbatches
    if actions > MAX_ACTIONS:
        raise ValueError(
            f"{where}{num_ranks} ranks x "
            + (f"{num_chunks} stages per rank x " if num_chunks > 1 else "")
            + f"{num_microbatches} microbatches make at least {actions:,} actions, more than "
            f"jpipe's limit of MAX_ACTIONS={MAX_ACTIONS:,} (jpipe.schedule.actions.MAX_ACTIONS; "
            "building and checking that many takes minutes); use fewer microbatches "
            "(larger ones) or fewer ranks"
        )


@dataclasses.dataclass(frozen=True, order=True)
class Action:
    """One unit of pipeline work: `kind` of `stage` on `microbatch`.

    Attributes:
      kind: ``"F"``, ``"B"``, ``"I"`` or ``"W"``, or a memory action
        (`MEMORY_KINDS`: ``"FC"``, ``"RECOMPUTE"``, ``"EVICT"``, ``"LOAD"``,
        ``"OFFLOAD_START"``, ``"OFFLOAD_END"``, ``"RELOAD_START"``,
        ``"RELOAD_END"``; see the module docstring).
      stage: the pipeline stage, counted from 0 (the one that embeds inputs).
      microbatch: the microbatch, counted from 0.
      partner: for ``EVICT`` and ``LOAD`` only, the rank that holds the
        residuals in between; `None` for every other kind.
    """

    kind: str
    stage: int
    microbatch: int
    partner: int | None = None

    def __post_init__(self):
        if self.kind not in ALL_KINDS:
            raise ValueError(
                f"Action kind must be one of {', '.join(ALL_KINDS)}, got {self.kind!r}"
            )
        for name in ("stage", "microbatch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"Action {name} must be an int, got {value!r}")
        if self.kind in PARTNER_KINDS:
            p = self.partner
            if not isinstance(p, int) or isinstance(p, bool):
                raise TypeError(
                    f"{self.kind} names the partner rank that holds the residuals: "
                    f"{self.kind}(stage, microbatch, partner), got partner={p!r}"
                )
        elif self.partner is not None:
            raise ValueError(f"only EVICT and LOAD name a partner rank, not {self.kind}")

    @property
    def is_memory(self) -> bool:
        """Whether this is a memory action (`MEMORY_KINDS`)."""
        return self.kind in MEMORY_KINDS

    @property
    def key(self) -> tuple[int, int]:
        """The `(stage, microbatch)` pair this action works on."""
        return (self.stage, self.microbatch)

    @property
    def parts(self) -> tuple[Action, ...]:
        return (self,)

    def __str__(self) -> str:
        tail = "" if self.partner is None else f"@{self.partner}"
        return f"{self.stage}{self.kind}{self.microbatch}{tail}"

    def __repr__(self) -> str:
        tail = "" if self.partner is None else f",{self.partner}"
        return f"{self.kind}({self.stage},{self.microbatch}{tail})"


@dataclasses.dataclass(frozen=True)
class Overlap:
    """A forward of one stage run together with a backward of another.

    DualPipe's overlapped cell. Its meaning is its two parts in order:
    `forward` first, then `backward`; both stages must live on the same rank.
    The per-rank lowering runs the cell as one program holding both halves
    (or as its halves apart, where the backward needs what the forward
    starts); the SPMD program as one branch where its halves share a tick
    (the packed tick layout puts them so). See docs/schedules.md,
    "Overlapped cells".
    """

    forward: Action
    backward: Action

    def __post_init__(self):
        if not isinstance(self.forward, Action) or self.forward.kind != "F":
            raise ValueError(f"Overlap.forward must be an F action, got {self.forward!r}")
        if not isinstance(self.backward, Action) or self.backward.kind not in ("B", "I"):
            raise ValueError(f"Overlap.backward must be a B or I action, got {self.backward!r}")

    @property
    def parts(self) -> tuple[Action, Action]:
        return (self.forward, self.backward)

    def __str__(self) -> str:
        return f"({self.forward};{self.backward})OVERLAP_F_B"

    def __repr__(self) -> str:
        return f"Overlap({self.forward!r}, {self.backward!r})"


Step = Action | Overlap


def F(stage: int, microbatch: int) -> Action:
    """The forward of `stage` on `microbatch`."""
    return Action("F", stage, microbatch)


def B(stage: int, microbatch: int) -> Action:
    """The full backward (input and weight gradient) of `stage` on `microbatch`."""
    return Action("B", stage, microbatch)


def I(stage: int, microbatch: int) -> Action:  # noqa: E743 (the papers' name)
    """The input-gradient half of the backward of `stage` on `microbatch`."""
    return Action("I", stage, microbatch)


def W(stage: int, microbatch: int) -> Action:
    """The weight-gradient half of the backward of `stage` on `microbatch`."""
    return Action("W", stage, microbatch)


def FC(stage: int, microbatch: int) -> Action:
    """A forward of `stage` on `microbatch` that keeps only its input.

    Its residuals are rebuilt by `RECOMPUTE` before the stage's ``B`` or ``I``.
    """
    return Action("FC", stage, microbatch)


def RECOMPUTE(stage: int, microbatch: int) -> Action:
    """Rebuilds the residuals of an `FC` from its kept input (the cost of a forward)."""
    return Action("RECOMPUTE", stage, microbatch)


def EVICT(stage: int, microbatch: int, partner: int) -> Action:
    """Moves the residuals of `(stage, microbatch)` to rank `partner`, which holds them."""
    return Action("EVICT", stage, microbatch, partner)


def LOAD(stage: int, microbatch: int, partner: int) -> Action:
    """Brings evicted residuals back from rank `partner`; their reader waits for it."""
    return Action("LOAD", stage, microbatch, partner)


def OFFLOAD_START(stage: int, microbatch: int) -> Action:
    """Begins copying the residuals of `(stage, microbatch)` to host memory."""
    return Action("OFFLOAD_START", stage, microbatch)


def OFFLOAD_END(stage: int, microbatch: int) -> Action:
    """Waits for the copy to host to finish and frees the device copy."""
    return Action("OFFLOAD_END", stage, microbatch)


def RELOAD_START(stage: int, microbatch: int) -> Action:
    """Begins copying offloaded residuals back to the device (their buffer is taken here)."""
    return Action("RELOAD_START", stage, microbatch)


def RELOAD_END(stage: int, microbatch: int) -> Action:
    """Waits for the copy back from host; the residuals can be read after it."""
    return Action("RELOAD_END", stage, microbatch)


def _slice_lengths(slices) -> tuple[int, ...]:
    """`Schedule.slices` from what a user gives: a count of even slices or their lengths."""
    if isinstance(slices, int) and not isinstance(slices, bool):
        if slices < 1:
            raise ValueError(f"slices must be a positive number of slices, got {slices}")
        slices = (1,) * slices if slices > 1 else ()
    try:
        lengths = tuple(slices)
    except TypeError:
        raise TypeError(
            f"slices must be a number of even slices or their lengths, got {slices!r}"
        ) from None
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in lengths):
        raise ValueError(f"slice lengths must be positive integers, got {lengths!r}")
    if len(lengths) == 1:
        raise ValueError(
            f"slices={lengths!r} cuts each sequence into one slice: leave slices out for "
            "whole sequences"
        )
    return lengths


def parse_action(text: str) -> Step:
    """Reads one CSV cell such as ``2F0`` or ``(0F7;7B3)OVERLAP_F_B``."""
    match = _OVERLAP_RE.match(text)
    if match:
        fwd, bwd = (parse_action(part) for part in match.groups())
        return Overlap(fwd, bwd)
    match = _CELL_RE.match(text)
    if not match:
        raise ValueError(
            f"cannot read schedule cell {text!r}: expected STAGE KIND MICROBATCH "
            "like '2F0' or '1I3', or '(0F7;7B3)OVERLAP_F_B', with KIND one of F, B, I, W "
            "or a memory action (FC, RECOMPUTE, EVICT and LOAD with @PARTNER as in "
            "'2EVICT0@5', OFFLOAD_START, OFFLOAD_END, RELOAD_START, RELOAD_END)"
        )
    stage, kind, microbatch, partner = match.groups()
    if (partner is None) == (kind in PARTNER_KINDS):
        need = "needs @PARTNER, as in '2EVICT0@5'" if partner is None else "takes no @PARTNER"
        raise ValueError(f"cannot read schedule cell {text!r}: {kind} {need}")
    return Action(kind, int(stage), int(microbatch), None if partner is None else int(partner))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """An ordered list of actions for each rank; rank `r` runs `ranks[r]`.

    Build one from lists (of `Action`, `Overlap`, or cells like ``"2F0"``)
    with `Schedule.of`, or read PyTorch's CSV with `Schedule.from_csv`.

    Attributes:
      ranks: one tuple of actions per rank, in execution order.
      name: a label for charts and messages; not part of equality.
      slices: empty for whole sequences (the usual case); else the relative
        lengths of the slices each sequence is cut into along its tokens
        (Seq1F1B), and each microbatch of the lists is one slice: microbatch
        ``u`` is slice ``u % k`` of sequence ``u // k`` (``k = len(slices)``,
        `slice_of`). A stage carries the keys and values seen so far from one
        slice of a sequence to the next, so the validator asks that a stage
        run all slices of a sequence on one rank, their forwards in slice
        order and their backwards in reverse (docs/schedules.md, "Sequence
        slices"). ``Schedule.of(rows, slices=4)`` cuts each sequence into 4
        even slices.
    """

    ranks: tuple[tuple[Step, ...], ...]
    name: str = dataclasses.field(default="", compare=False)
    slices: tuple[int, ...] = ()

    def __post_init__(self):
        if not isinstance(self.ranks, tuple) or not all(
            isinstance(row, tuple) and all(isinstance(a, (Action, Overlap)) for a in row)
            for row in self.ranks
        ):
            raise TypeError(
                "Schedule(ranks) takes a tuple of tuples of Action/Overlap; use "
                "Schedule.of(lists) to build one from lists or strings like '2F0'"
            )
        object.__setattr__(self, "slices", _slice_lengths(self.slices))

    @classmethod
    def of(
        cls,
        ranks: Iterable[Iterable[Step | str | None]],
        name: str = "",
        slices: int | Sequence[int] = (),
    ) -> Schedule:
        """Builds a schedule from per-rank lists; strings are parsed, `None` skipped.

        `slices`: a number of even slices each sequence is cut into, or their
        relative lengths (`Schedule.slices`); each microbatch of the lists is then
        one slice. Cells written ``2F1.3`` (stage 2, forward, sequence 1, slice 3)
        are read so too.
        """
        rows = []
        for row in ranks:
            cells = []
            for cell in row:
                if cell is None or (isinstance(cell, str) and not cell.strip()):
                    continue
                if isinstance(cell, str):
                    cell = parse_action(cell)
                if not isinstance(cell, (Action, Overlap)):
                    raise TypeError(f"a schedule holds Action or Overlap entries, got {cell!r}")
                cells.append(cell)
            rows.append(tuple(cells))
        return cls(tuple(rows), name=name, slices=slices)

    # -- shape -----------------------------------------------------------------

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    def actions(self, rank: int) -> tuple[Action, ...]:
        """The rank's plain actions in order, with overlapped cells split."""
        return tuple(part for step in self.ranks[rank] for part in step.parts)

    def all_actions(self) -> Iterable[tuple[int, int, Action]]:
        """Every plain action as `(rank, position, action)`; position is in the rank's row."""
        for r, row in enumerate(self.ranks):
            for pos, step in enumerate(row):
                for part in step.parts:
                    yield r, pos, part

    @functools.cached_property  # the schedule is frozen: computed once
    def num_stages(self) -> int:
        stages = [a.stage for _, _, a in self.all_actions()]
        return max(stages) + 1 if stages else 0

    @functools.cached_property
    def num_microbatches(self) -> int:
        mbs = [a.microbatch for _, _, a in self.all_actions()]
        return max(mbs) + 1 if mbs else 0

    @property
    def num_slices(self) -> int:
        """How many slices each sequence is cut into (1: whole sequences)."""
        return len(self.slices) or 1

    @property
    def num_sequences(self) -> int:
        """How many sequences (microbatches of whole sequences) the lists cover."""
        return -(-self.num_microbatches // self.num_slices)

    def slice_of(self, microbatch: int) -> tuple[int, int]:
        """``(sequence, slice)`` of a microbatch of the lists (``(microbatch, 0)`` where
        sequences are whole)."""
        return divmod(microbatch, self.num_slices)

    def cell(self, step: Step) -> str:
        """`step` as a CSV cell of this schedule: ``2F0``, or ``2F1.3`` (sequence 1,
        slice 3) where sequences are sliced."""
        if not self.slices:
            return str(step)
        if isinstance(step, Overlap):
            return f"({self.cell(step.forward)};{self.cell(step.backward)})OVERLAP_F_B"
        sequence, piece = self.slice_of(step.microbatch)
        tail = "" if step.partner is None else f"@{step.partner}"
        return f"{step.stage}{step.kind}{sequence}.{piece}{tail}"

    @functools.cached_property
    def stage_ranks(self) -> tuple[tuple[int, ...], ...]:
        """The ranks that hold each stage, in increasing order: one rank, or several
        where the stage is replicated (`replicated`)."""
        held: list[set[int]] = [set() for _ in range(self.num_stages)]
        for r, _, a in self.all_actions():
            held[a.stage].add(r)
        return tuple(tuple(sorted(ranks)) for ranks in held)

    @functools.cached_property
    def replicated(self) -> bool:
        """Whether some stage runs on several ranks, each holding a copy of its
        parameters (Chimera's two pipelines): its gradients are summed over the copies."""
        return any(len(ranks) > 1 for ranks in self.stage_ranks)

    @functools.cached_property
    def stage_to_rank(self) -> tuple[int, ...]:
        """The rank of each stage (the first rank that mentions it; of a replicated
        stage, the first of its ranks in list order; `stage_ranks` has them all)."""
        placement: dict[int, int] = {}
        for r, _, a in self.all_actions():
            placement.setdefault(a.stage, r)
        return tuple(placement.get(s, -1) for s in range(self.num_stages))

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages placed on `rank` (replicas included), in increasing order."""
        return tuple(s for s, ranks in enumerate(self.stage_ranks) if rank in ranks)

    @functools.cached_property
    def has_memory_actions(self) -> bool:
        """Whether any action is a memory action (`MEMORY_KINDS`)."""
        return any(a.kind in MEMORY_KINDS for _, _, a in self.all_actions())

    def without_memory_actions(self) -> Schedule:
        """The same compute order with every residual kept on its rank.

        Each ``FC`` becomes an ``F`` and every other memory action is dropped:
        the schedule the memory actions were added to.
        """
        if not self.has_memory_actions:
            return self
        rows = []
        for row in self.ranks:
            cells = []
            for step in row:
                if isinstance(step, Action) and step.kind == "FC":
                    step = Action("F", step.stage, step.microbatch)
                elif isinstance(step, Action) and step.kind in MEMORY_KINDS:
                    continue
                cells.append(step)
            rows.append(tuple(cells))
        return Schedule(tuple(rows), name=self.name, slices=self.slices)

    @functools.cached_property
    def splits_backward(self) -> bool:
        """Whether any backward is split into I and W (the planner costs them apart)."""
        return any(a.kind == "W" for _, _, a in self.all_actions())

    # -- text ------------------------------------------------------------------

    def to_rows(self) -> list[list[str]]:
        return [[self.cell(step) for step in row] for row in self.ranks]

    def to_csv(self, path: str | os.PathLike | None = None, *, pytorch: bool = False) -> str:
        """Writes PyTorch's CSV form to `path` (if given) and returns it as text.

        The form has no marker for a rank with no actions: such ranks at the
        end of the schedule do not survive a round trip. jpipe writes its
        superset of the form (memory actions, stages on several ranks; the
        module docstring); with `pytorch`, for a file PyTorch's runtime is to
        run, what only jpipe reads is refused by name instead
        (`pytorch_gaps`).
        """
        if pytorch:
            gaps = self.pytorch_gaps()
            if gaps:
                raise ValueError(
                    f"PyTorch's pipelining cannot run this schedule as written: {gaps[0]}"
                    + (f" (and {len(gaps) - 1} more)" if len(gaps) > 1 else "")
                )
        if len(set(self.slices)) > 1:
            raise ValueError(
                f"the CSV form names each cell's slice but not the slices' lengths, so "
                f"uneven slices {self.slices} would read back even; keep this schedule in "
                "Python (a built-in or file.py:function), or read the file back with "
                f"Schedule.from_csv(path, slices={self.slices})"
            )
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(self.to_rows())
        text = buf.getvalue()
        if path is not None:
            with open(path, "w", newline="") as f:
                f.write(text)
        return text

    def pytorch_gaps(self) -> list[str]:
        """What of this schedule PyTorch's pipelining cannot run, one line each: sequence
        slices (its microbatches are whole sequences), stages on several ranks (it places
        each stage on one) and memory actions (it has none)."""
        gaps = []
        if self.slices:
            first = next((self.cell(a) for row in self.ranks for a in row), "0F0.1")
            gaps.append(
                f"each sequence is cut into {self.num_slices} slices (cells such as {first}); "
                "PyTorch's microbatches are whole sequences"
            )
        gaps += [
            f"stage {s} is on ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}; "
            "PyTorch places a stage on one rank"
            for s, ranks in enumerate(self.stage_ranks)
            if len(ranks) > 1
        ]
        for r, pos, a in self.all_actions():
            if a.kind in MEMORY_KINDS:
                gaps.append(
                    f"rank {r}, position {pos} ({a!r}) is a memory action, jpipe's own cell "
                    f"{a}; PyTorch's schedules have none"
                )
        return gaps

    @classmethod
    def from_csv_text(
        cls, text: str, name: str = "", slices: int | Sequence[int] | None = None
    ) -> Schedule:
        """Reads PyTorch's CSV form from a string; see `from_csv`."""
        where = name or "CSV"
        k, slices = _slices_in(text, where, slices)
        commas = text.count(",")  # cells less one a row: a bound found without parsing
        if commas >= MAX_ACTIONS:
            raise ValueError(
                f"{where}: at least {commas + 1:,} cells, past jpipe's limit of MAX_ACTIONS="
                f"{MAX_ACTIONS:,} (jpipe.schedule.actions.MAX_ACTIONS)"
            )
        # Any line end (\n, \r\n or a lone \r) ends a row; a leading BOM is not a cell.
        lines = io.StringIO(text.removeprefix("\ufeff"), newline=None)
        rows, num_actions = [], 0
        reader = csv.reader(lines, strict=True)
        while True:
            try:
                row = next(reader, None)
            except csv.Error as e:
                raise ValueError(
                    f"{where} row {reader.line_num}: not CSV ({e}); write one rank per "
                    "line and one action per cell, such as 0F0,0F1,0B0"
                ) from None
            if row is None:
                break
            lineno = reader.line_num
            if lineno > MAX_RANKS and any(c.strip() for c in row):
                raise ValueError(
                    f"{where} row {lineno}: more than jpipe's limit of MAX_RANKS={MAX_RANKS} "
                    "ranks (jpipe.schedule.actions.MAX_RANKS; one row a rank)"
                )
            num_actions += len(row)
            if num_actions > MAX_ACTIONS:
                raise ValueError(
                    f"{where} row {lineno}: more than jpipe's limit of MAX_ACTIONS="
                    f"{MAX_ACTIONS:,} cells (jpipe.schedule.actions.MAX_ACTIONS)"
                )
            cells, dropped = [], []
            for col, cell in enumerate(row, start=1):
                if not cell.strip():
                    continue
                try:
                    step, names = _read_csv_cell(_unslice_cell(cell, k) if k else cell)
                    for a in () if step is None else step.parts:
                        _check_index(a)
                except ValueError as e:
                    raise ValueError(f"{where} row {lineno} column {col}: {e}") from None
                if step is not None:
                    cells.append(step)
                dropped.extend((col, stage, text) for stage, text in names)
            held = sorted({a.stage for step in cells for a in step.parts})
            for col, stage, cell in dropped:
                if stage not in held:
                    raise ValueError(
                        f"{where} row {lineno} column {col}: {cell!r} names stage "
                        f"{stage}, which this rank does not compute (its stages: "
                        f"{', '.join(map(str, held)) or 'none'}); PyTorch writes a rank's "
                        "transfer, FSDP and gradient cells for its own stages"
                    )
            rows.append(cells)
        while rows and not rows[-1]:
            rows.pop()  # a trailing empty line is not a rank
        return cls.of(_undo_legacy_b(rows), name=name, slices=slices)

    @classmethod
    def from_csv(
        cls, path: str | os.PathLike, slices: int | Sequence[int] | None = None
    ) -> Schedule:
        """Reads a schedule written in PyTorch's CSV form.

        Blank cells are skipped. A ``B`` followed later on the same rank by a
        ``W`` of the same stage and microbatch is read as ``I`` (the older
        PyTorch convention). Transfer, FSDP and gradient-reduction cells
        (`DROPPED_CSV_KINDS`) are dropped once checked to name a stage of
        their rank, so positions in errors count compute cells only.

        jpipe's superset: cells ``2F1.3`` name sequence 1's slice 3 (`Schedule.slices`);
        the file gives the number of slices, `slices` their lengths where uneven.
        """
        try:
            with open(path, newline="", encoding="utf-8-sig") as f:
                text = f.read()
        except UnicodeDecodeError as e:
            raise ValueError(f"{os.fspath(path)} is not a UTF-8 text file: {e}") from None
        return cls.from_csv_text(text, name=os.path.basename(os.fspath(path)), slices=slices)

    def __str__(self) -> str:
        width = max((len(self.cell(s)) for row in self.ranks for s in row), default=1)
        lines = [f"Schedule {self.name or ''}".rstrip() + ":"]
        for r, row in enumerate(self.ranks):
            lines.append(f"  rank {r}: " + " ".join(f"{self.cell(s):>{width}}" for s in row))
        return "\n".join(lines)


_SLICED_CELL_RE = re.compile(r"(\d+)\s*([A-Z_]+)\s*(\d+)\.(\d+)")
_PLAIN_CELL_RE = re.compile(r"\d+\s*[A-Z_]+\s*\d+(?![\d.])")


def _slices_in(text: str, where: str, slices) -> tuple[int, tuple[int, ...]]:
    """``(k, lengths)``: how many slices the sliced cells of `text` (``2F1.3``: sequence
    1, slice 3) cut each sequence into (0: none are sliced), and the slices' lengths,
    from `slices` where given."""
    found = _SLICED_CELL_RE.findall(text)
    if not found:
        return 0, () if slices is None else _slice_lengths(slices)
    k = max(int(piece) for *_, piece in found) + 1
    lengths = _slice_lengths(k if slices is None else slices)
    if len(lengths) != k:
        raise ValueError(
            f"{where}: its cells cut each sequence into {k} slices, but slices={slices!r} "
            f"gives {len(lengths)}"
        )
    return k, lengths


def _unslice_cell(text: str, k: int) -> str:
    """A cell of a sliced file with each part's ``SEQUENCE.SLICE`` written as the
    microbatch it is (``2F1.3`` -> ``2F7`` with 4 slices); a part that names no slice
    is refused."""
    plain = _PLAIN_CELL_RE.search(_SLICED_CELL_RE.sub("", text))
    if plain:
        raise ValueError(
            f"cell {text.strip()!r} names no slice, where other cells do; in a sliced "
            "schedule every cell is STAGE KIND SEQUENCE.SLICE, such as 2F1.3"
        )
    return _SLICED_CELL_RE.sub(lambda m: f"{m[1]}{m[2]}{int(m[3]) * k + int(m[4])}", text)


def _read_csv_cell(text: str) -> tuple[Step | None, list[tuple[int, str]]]:
    """One CSV cell: its compute step (or None) and the ``(stage, text)`` of cells dropped.

    An ``OVERLAP_F_B`` cell may hold dropped cells among its parts; with one
    compute part left it is that part.
    """
    match = _DROPPED_RE.match(text)
    if match:
        return None, [(int(match.group(1)), text.strip())]
    match = _ANY_OVERLAP_RE.match(text)
    if match:
        parts = [p.strip() for p in match.group(1).split(";")]
        dropped = [(int(m.group(1)), p) for p in parts if (m := _DROPPED_RE.match(p))]
        if dropped:
            kept = [p for p in parts if not _DROPPED_RE.match(p)]
            if not kept:
                return None, dropped
            if len(kept) == 1:
                return parse_action(kept[0]), dropped
            return parse_action(f"({';'.join(kept)})OVERLAP_F_B"), dropped
    return parse_action(text), []


def _check_index(a: Action) -> None:
    """Refuses a stage, microbatch or partner index no schedule within the limits has."""
    for what, value, limit in (
        ("stage", a.stage, MAX_ACTIONS // 2),
        ("microbatch", a.microbatch, MAX_ACTIONS // 2),
        ("partner rank", a.partner, MAX_RANKS),
    ):
        if value is not None and value >= limit:
            raise ValueError(
                f"{a}: {what} {value:,} is past what a schedule within jpipe's limits has "
                f"(MAX_RANKS={MAX_RANKS}, MAX_ACTIONS={MAX_ACTIONS:,}; jpipe.schedule.actions)"
            )


def _undo_legacy_b(rows: Sequence[Sequence[Step]]) -> list[list[Step]]:
    """Rewrites ``B`` as ``I`` where a ``W`` of the same key follows on that rank."""
    fixed = []
    for row in rows:
        w_keys: set = set()  # keys whose W comes later than the current cell
        for step in row:
            w_keys.update(a.key for a in step.parts if a.kind == "W")
        new_row = []
        for step in row:
            for a in step.parts:
                if a.kind == "W":
                    w_keys.discard(a.key)
            if isinstance(step, Action) and step.kind == "B" and step.key in w_keys:
                step = Action("I", step.stage, step.microbatch)
            elif (
                isinstance(step, Overlap)
                and step.backward.kind == "B"
                and step.backward.key in w_keys
            ):
                step = Overlap(step.forward, Action("I", *step.backward.key))
            new_row.append(step)
        fixed.append(new_row)
    return fixed
