"""Validation: is this schedule complete, consistent and free of deadlock?

`validate` checks, in this order, and stops at the first problem with a
`ScheduleError` that names the rank, the position in its list, the action, and
what is wrong:

1. indices: stages and microbatches are non-negative (and below the expected
   counts, when given);
2. duplicates: no action appears twice;
3. placement: every `(stage, microbatch)` runs on one rank, its forward's (a
   stage may run on several: replicas, each with its copy of the parameters);
4. completeness: every `(stage, microbatch)` has one `F` and either one `B` or
   one `I` and one `W`, and no stage or microbatch is missing;
5. order on a rank: a backward after its own forward, a `W` after its `I`;
6. deadlock: the ranks are run as a dependency graph (each rank in its list
   order, an action waiting for the actions it depends on); if they get stuck,
   the message names the blocked action on every stuck rank and what it waits
   for. The walk visits each action once, so it never hangs;
7. optionally, a budget of live activations per rank.

Memory actions (`jpipe.schedule.actions.MEMORY_KINDS`) are checked in step 5, on
the owner rank in its list order, each `(stage, microbatch)`'s residuals
being in one place at a time: on the device (after ``F``, ``RECOMPUTE``,
``LOAD`` or ``RELOAD_END``), only the input (after ``FC``), evicted to a
partner (``EVICT`` to ``LOAD``), or offloaded (``OFFLOAD_START`` to
``RELOAD_END``). So a ``LOAD`` comes after its ``EVICT``, names the same
partner and comes before the residuals' reader; a reload after its offload,
each end after its start; a ``RECOMPUTE`` after an ``FC`` and before the
``B`` or ``I`` that needs it; nothing reads residuals (``RECOMPUTE``, ``B``,
``I``, ``W``) while they are evicted or offloaded, and nothing moves them
once ``B`` or ``W`` has freed them. Each kind appears at most once per
`(stage, microbatch)`; a partner is another rank of the schedule. An
evicted microbatch counts on its partner: ``peak_live`` and ``max_live``
include what a rank holds for another, placed in time by running the
schedule with unit costs (`jpipe.Costs()`, transfers free).

Dependencies: ``F(s,m)`` after ``F(s-1,m)``; the backward of ``(s,m)`` (``B`` or
``I``) after ``F(s,m)`` and after the backward of ``(s+1,m)``; ``W(s,m)`` after
``I(s,m)``.

The walk also yields the order in which actions can run, which the simulator
and the compiler's planner reuse.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence

from jpipe.schedule.actions import MEMORY_KINDS, Action, Schedule
from jpipe.schedule.events import Costs, _live_events, _run

ONE_RANK_A_KEY = (
    "A stage may run on several ranks (replicas, as in Chimera: each rank keeps a copy "
    "of its parameters, their gradients summed over the copies), but one microbatch of "
    "it runs on one of them"
)
"""What the refusal of a microbatch's actions on two ranks explains (step 2)."""


class ScheduleError(ValueError):
    """A schedule that cannot run; the message says where and why."""


def replicas_text(schedule: Schedule) -> str:
    """The replicated stages of `schedule` in words, such as ``stage 0 on ranks 0 and 3``."""
    said = [
        f"stage {s} on ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"
        for s, ranks in enumerate(schedule.stage_ranks)
        if len(ranks) > 1
    ]
    return "; ".join(said[:3]) + ("; ..." if len(said) > 3 else "")


def _count(n: int, noun: str) -> str:
    plural = {"microbatch": "microbatches"}.get(noun, noun + "s")
    return f"{n} {noun if n == 1 else plural}"


def _where(rank: int, pos: int, action) -> str:
    return f"rank {rank}, position {pos} ({action!r})"


@dataclasses.dataclass(frozen=True)
class Analysis:
    """What validation learned; used by the simulator, the tick planner and the search.

    Attributes:
      num_stages, num_microbatches: the schedule's sizes.
      stage_to_rank: the rank of each stage (`Schedule.stage_to_rank`: of a
        replicated stage, the first of its ranks).
      key_rank: the rank that runs each `(stage, microbatch)`, at
        ``stage * num_microbatches + microbatch`` (where its forward runs).
      order: every plain action as `(rank, index)` in an order that respects
        all dependencies, `index` counting the rank's plain actions
        (`Schedule.actions`).
      rows: each rank's plain actions (`Schedule.actions`), read once here so
        that the passes after validation need not split the cells again.
      peak_live: the most live activations on each rank (with memory
        actions, what it holds for a partner included; see the module
        docstring). With memory actions it takes a run of the schedule in
        time, done the first time it is read (the simulator counts its own
        and never reads it then; the search never does).
    """

    num_stages: int
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    key_rank: tuple[int, ...]
    order: tuple[tuple[int, int], ...]
    rows: tuple[tuple[Action, ...], ...] = dataclasses.field(repr=False)
    # the peaks, or a function that computes them (`peak_live`)
    _peak: tuple[int, ...] | Callable[[], tuple[int, ...]] = dataclasses.field(
        repr=False, compare=False
    )

    @property
    def peak_live(self) -> tuple[int, ...]:
        peak = self._peak
        if callable(peak):
            peak = peak()
            object.__setattr__(self, "_peak", peak)  # frozen, but computed once
        return peak


def validate(
    schedule: Schedule,
    *,
    num_stages: int | None = None,
    num_microbatches: int | None = None,
    max_live: int | Sequence[int] | None = None,
) -> Schedule:
    """Checks `schedule` and returns it unchanged; raises `ScheduleError` if bad.

    Args:
      schedule: the schedule to check.
      num_stages: if given, the number of stages the schedule must have.
      num_microbatches: if given, the number of microbatches it must have.
      max_live: if given, a budget of live activations (one per rank, or one
        for all): a `(stage, microbatch)` is live from its ``F`` until its
        ``B`` or ``W`` has run.
    """
    analyze(schedule, num_stages=num_stages, num_microbatches=num_microbatches, max_live=max_live)
    return schedule


def analyze(
    schedule: Schedule,
    *,
    num_stages: int | None = None,
    num_microbatches: int | None = None,
    max_live: int | Sequence[int] | None = None,
) -> Analysis:
    """Like `validate`, but returns what it learned (see `Analysis`).

    The analysis of a schedule on its own (no bound given) is done once and
    kept on the schedule, which is immutable: the passes after validation (the
    simulator, the plans, the pipeline) are handed it instead of redoing it.
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(f"expected a jpipe.Schedule, got {type(schedule).__name__}")
    if num_stages is None and num_microbatches is None and max_live is None:
        cached = schedule.__dict__.get("_analysis")
        if cached is None:
            cached = _analyze(schedule, None, None, None)
            object.__setattr__(schedule, "_analysis", cached)  # frozen, but not a field
        return cached
    return _analyze(schedule, num_stages, num_microbatches, max_live)


def _rows(schedule: Schedule) -> tuple[tuple[Action, ...], ...]:
    """Each rank's plain actions (`Schedule.actions`): a rank's row as it is where each
    cell is one action (the usual case), so that no action is copied."""
    return tuple(
        row if set(map(type, row)) <= {Action} else tuple(p for step in row for p in step.parts)
        for row in schedule.ranks
    )


def _analyze(schedule: Schedule, num_stages, num_microbatches, max_live) -> Analysis:
    """The dependency analysis: indices, dependencies, deadlocks, liveness."""
    rows = _rows(schedule)
    cell_pos = _cell_positions(rows, schedule)
    if not any(rows):
        raise ScheduleError("the schedule has no actions")

    # 1. indices
    S, M = _check_indices(rows, cell_pos, num_stages, num_microbatches)
    # 2. duplicates, 3. placement
    memory = schedule.has_memory_actions
    at, where = _place(rows, cell_pos, S, M, memory)
    owner = schedule.stage_to_rank
    # 4. completeness
    if num_microbatches is None:
        _refuse_a_stray_microbatch(rows, cell_pos, S, M, where)
    _check_complete(at, owner, schedule.stage_ranks, where, S, M)
    # 5. order on one rank
    _check_rank_order(rows, cell_pos, where, S, M)
    # 5a. a sequence's slices on one rank per stage, in slice order (the carry)
    if schedule.slices:
        _check_slices(schedule, rows, cell_pos, where, S, M)
    # 5b. where each (stage, microbatch)'s residuals are, along its owner's list
    if memory:
        _check_residual_places(rows, cell_pos, M)

    # 6. deadlock: walk the dependency graph
    order, peak = _walk(rows, cell_pos, S, M, at)
    if memory:  # what a rank holds for a partner is placed in time
        if max_live is None:  # nothing to check: run in time only if the peaks are read

            def peak_live(rows=rows, order=order, S=S, M=M, at=at):
                return tuple(_held_in_time(rows, None, order, S, M, at, None)[0])

            return Analysis(S, M, owner, tuple(at), tuple(order), rows, peak_live)
        budgets = _budgets(max_live, len(rows))
        peak, over = _held_in_time(rows, cell_pos, order, S, M, at, budgets)
        if over:
            raise ScheduleError(over)
        return Analysis(S, M, owner, tuple(at), tuple(order), rows, tuple(peak))

    # 7. live-activation budget
    if max_live is not None:
        _check_budget(rows, cell_pos, _budgets(max_live, len(rows)))
    return Analysis(S, M, owner, tuple(at), tuple(order), rows, tuple(peak))


def _cell_positions(rows, schedule: Schedule) -> list:
    """The position of each action in the rank's row as written (an Overlap cell is one)."""
    return [
        range(len(row)) if len(row) == len(cells) else
        [pos for pos, step in enumerate(cells) for _ in step.parts]
        for row, cells in zip(rows, schedule.ranks)
    ]  # fmt: skip


def _check_indices(rows, cell_pos, num_stages, num_microbatches) -> tuple[int, int]:
    """Step 1: every index in range, every stage and microbatch scheduled; `(S, M)`.

    Each set is checked at once, then each action in turn only where one is wrong.
    """
    R = len(rows)
    stages_seen = {a.stage for row in rows for a in row}
    mbs_seen = {a.microbatch for row in rows for a in row}
    partners = [{a.partner for a in row} - {None} for row in rows]
    wrong = (
        min(stages_seen) < 0
        or min(mbs_seen) < 0
        or (num_stages is not None and max(stages_seen) >= num_stages)
        or (num_microbatches is not None and max(mbs_seen) >= num_microbatches)
        or any(not (0 <= p < R and p != r) for r in range(R) for p in partners[r])
    )
    for r, row in enumerate(rows if wrong else ()):  # raises at the first one wrong
        for i, a in enumerate(row):
            _check_action_indices(r, cell_pos[r][i], a, R, num_stages, num_microbatches)
    S = num_stages if num_stages is not None else max(stages_seen) + 1
    M = num_microbatches if num_microbatches is not None else max(mbs_seen) + 1
    _check_all_scheduled(rows, cell_pos, S, M, stages_seen, mbs_seen)
    return S, M


def _check_action_indices(r, pos, a, num_ranks, num_stages, num_microbatches) -> None:
    """Refuses action `a` (rank `r`, position `pos`) if an index of it is out of range."""
    if a.stage < 0 or a.microbatch < 0:
        raise ScheduleError(f"{_where(r, pos, a)}: stage and microbatch must be >= 0")
    if num_stages is not None and a.stage >= num_stages:
        raise ScheduleError(
            f"{_where(r, pos, a)}: stage {a.stage} is out of range; "
            f"the model has {_count(num_stages, 'stage')} (0..{num_stages - 1})"
        )
    if num_microbatches is not None and a.microbatch >= num_microbatches:
        raise ScheduleError(
            f"{_where(r, pos, a)}: microbatch {a.microbatch} is out of "
            f"range; there {'is' if num_microbatches == 1 else 'are'} "
            f"{_count(num_microbatches, 'microbatch')} (0..{num_microbatches - 1})"
        )
    if a.partner is not None and not (0 <= a.partner < num_ranks and a.partner != r):
        raise ScheduleError(
            f"{_where(r, pos, a)}: partner rank {a.partner} must be another "
            f"rank of the schedule (0..{num_ranks - 1}, not {r} itself)"
        )


def _check_all_scheduled(rows, cell_pos, S, M, stages_seen, mbs_seen) -> None:
    """Refuses a stage or microbatch below the highest that no action names.

    Checked before anything of size S * M is built, so a stray huge index is
    reported rather than allocated.
    """

    def highest(attr):
        """Where the action with the largest `attr` first appears."""
        best = None
        for r, row in enumerate(rows):
            for i, a in enumerate(row):
                if best is None or getattr(a, attr) > getattr(rows[best[0]][best[1]], attr):
                    best = (r, i)
        r, i = best
        return _where(r, cell_pos[r][i], rows[r][i])

    for s in range(S):
        if s not in stages_seen:
            raise ScheduleError(
                f"stage {s} appears on no rank; stages 0..{S - 1} must all be scheduled "
                f"(the highest stage is at {highest('stage')})"
            )
    for m in range(M):
        if m not in mbs_seen:
            raise ScheduleError(
                f"microbatch {m} is missing: no rank has an action for it "
                f"(microbatches 0..{M - 1} must all be scheduled; the highest is at "
                f"{highest('microbatch')})"
            )


def _place(rows, cell_pos, S, M, memory: bool) -> tuple[list[int], dict[str, list]]:
    """Steps 2 and 3: no action twice, each `(stage, microbatch)` on one rank; `(at, where)`.

    A stage may run on several ranks (replicas, each with its copy of the
    parameters); each of its microbatches runs wholly on one of them, the one
    that ran its forward, which holds its residuals. ``at[s * M + m]`` is that
    rank; ``where[kind][s * M + m]`` is the `(rank, index)` of that action, or
    None. An ``FC`` is the key's forward (in ``F``'s slot); each other memory
    kind has its own (with `memory`).
    """
    at: list[int] = [-1] * (S * M)  # the first rank seen running each key
    mixed = False  # some key seen on two ranks
    where: dict[str, list] = {kind: [None] * (S * M) for kind in ("F", "B", "I", "W")}
    if memory:
        where.update({kind: [None] * (S * M) for kind in MEMORY_KINDS if kind != "FC"})
    slots_of = {**where, "FC": where["F"]}
    for r, row in enumerate(rows):
        for i, a in enumerate(row):
            slots = slots_of[a.kind]
            k = a.stage * M + a.microbatch
            prev = slots[k]
            if prev is not None:
                first = rows[prev[0]][prev[1]]
                what = (
                    f"duplicate; {first!r}"
                    if first.kind == a.kind
                    else f"a second forward of ({a.stage},{a.microbatch}); {first!r}"
                )
                raise ScheduleError(
                    f"{_where(r, cell_pos[r][i], a)}: {what} already appears "
                    f"at rank {prev[0]}, position {cell_pos[prev[0]][prev[1]]}"
                )
            slots[k] = (r, i)
            if at[k] == -1:
                at[k] = r
            elif at[k] != r:
                mixed = True
    f_at = where["F"]
    for k, f in enumerate(f_at if mixed else ()):
        if f is not None:
            at[k] = f[0]
    for r, row in enumerate(rows if mixed else ()):  # raises at the first one away from its F
        for i, a in enumerate(row):
            f = f_at[a.stage * M + a.microbatch]
            if f is not None and f[0] != r:
                raise ScheduleError(
                    f"{_where(r, cell_pos[r][i], a)}: its forward, {rows[f[0]][f[1]]!r}, runs on "
                    f"rank {f[0]} (position {cell_pos[f[0]][f[1]]}); every action of "
                    f"({a.stage},{a.microbatch}) runs on the rank that runs its forward and "
                    f"holds its residuals. {ONE_RANK_A_KEY}"
                )
    return at, where


def _check_complete(at, owner, held, where, S, M) -> None:
    """Step 4: each key has its F and either a B or an I and a W.

    Checked at once, then key by key (which raises at the first wrong) only
    where one is wrong.
    """
    f_at, b_at, i_at, w_at = where["F"], where["B"], where["I"], where["W"]
    complete = None not in f_at and all(
        (b is None) != (i is None) and (i is None) == (w is None)
        for b, i, w in zip(b_at, i_at, w_at)
    )
    for s in range(0 if complete else S):
        for m in range(M):
            k = s * M + m
            r = at[k] if at[k] >= 0 else owner[s]
            who = f"rank {r} (which holds stage {s})"
            if at[k] < 0 and len(held[s]) > 1:
                *first, last = held[s]
                who = f"ranks {', '.join(map(str, first))} and {last} (which hold stage {s})"
            problem = None
            if f_at[k] is None:
                problem = f"F({s},{m}) is missing"
            elif b_at[k] is not None and (i_at[k] is not None or w_at[k] is not None):
                problem = f"({s},{m}) has both a B and an I/W backward; use one or the other"
            elif i_at[k] is not None and w_at[k] is None:
                problem = f"I({s},{m}) has no matching W({s},{m})"
            elif w_at[k] is not None and i_at[k] is None:
                problem = f"W({s},{m}) has no matching I({s},{m})"
            elif b_at[k] is None and i_at[k] is None:
                problem = (
                    f"the backward of ({s},{m}) is missing: add B({s},{m}) or I({s},{m}) "
                    f"and W({s},{m})"
                )
            if problem:
                raise ScheduleError(f"{who}: {problem}")


def _check_rank_order(rows, cell_pos, where, S, M) -> None:
    """Step 5: on one rank, a backward after its forward and a W after its I.

    Checked at once for every key, then key by key where one is out of order.
    """
    f_at, b_at, i_at, w_at = where["F"], where["B"], where["I"], where["W"]
    in_order = all(
        f[1] < b[1] if b is not None else f[1] < i[1] < w[1]
        for f, b, i, w in zip(f_at, b_at, i_at, w_at)
    )
    for k in range(0 if in_order else S * M):
        fi = f_at[k][1]
        for later, need in ((b_at[k], fi), (i_at[k], fi), (w_at[k], None)):
            if later is None:
                continue
            r, i = later
            if need is None:
                need = i_at[k][1]
            if need > i:
                a = rows[r][i]
                before = rows[r][need]  # the F (or FC) or the I
                raise ScheduleError(
                    f"{_where(r, cell_pos[r][i], a)}: comes before {before!r} at position "
                    f"{cell_pos[r][need]}, which it needs"
                )


def _check_slices(schedule: Schedule, rows, cell_pos, where, S: int, M: int) -> None:
    """Step 5a (sequence slices): each stage carries the keys and values of a sequence's
    earlier slices to its later ones, so it runs all slices of a sequence on one rank,
    each slice's forward after the forward of the slice before it, and each slice's
    backward (its ``B`` or ``I``, which passes the carry's gradient back) after the
    backward of the slice after it."""
    k = schedule.num_slices
    if M % k:
        raise ScheduleError(
            f"each sequence is cut into {k} slices, but the lists have {_count(M, 'microbatch')}"
            f", not whole sequences (slice u % {k} of sequence u // {k})"
        )
    if schedule.has_memory_actions:
        raise ScheduleError(
            "sequence slices with memory actions are not supported yet: a slice's residuals "
            "read the carry of the slices before it, which no memory action moves"
        )
    f_at = where["F"]
    back = [b if b is not None else i for b, i in zip(where["B"], where["I"])]
    for s in range(S):
        for m in range(M):
            if m % k == 0:
                continue
            key, before = s * M + m, s * M + m - 1
            (r, i), (r0, i0) = f_at[key], f_at[before]
            here, there = rows[r][i], rows[r0][i0]
            if r != r0:
                raise ScheduleError(
                    f"{_where(r, cell_pos[r][i], here)}: on rank {r}, but {there!r}, the "
                    f"slice before it of the same sequence, is on rank {r0}; a stage keeps "
                    "the keys and values of a sequence's slices (the carry) on one rank, "
                    "so it runs all of a sequence's slices there"
                )
            if i < i0:
                raise ScheduleError(
                    f"{_where(r, cell_pos[r][i], here)}: comes before {there!r} at position "
                    f"{cell_pos[r][i0]}, the slice before it, whose carry it reads"
                )
            (r, i), (r0, i0) = back[before], back[key]
            if i < i0:
                raise ScheduleError(
                    f"{_where(r, cell_pos[r][i], rows[r][i])}: comes before "
                    f"{rows[r0][i0]!r} at position {cell_pos[r0][i0]}, the slice after it, "
                    "which hands it the gradient of the carry"
                )


def _check_budget(rows, cell_pos, budgets: list[int]) -> None:
    """Step 7 (no memory actions): live activations along each rank's list within `budgets`."""
    for r, row in enumerate(rows):
        live = 0
        for i, a in enumerate(row):
            live += a.kind == "F"
            if live > budgets[r]:
                raise ScheduleError(
                    f"{_where(r, cell_pos[r][i], a)}: {live} live activations exceed "
                    f"the budget of {budgets[r]} on rank {r}"
                )
            live -= a.kind in ("B", "W")


def _budgets(max_live, num_ranks: int) -> list[int]:
    try:
        budgets = (
            [operator.index(max_live)] * num_ranks
            if not hasattr(max_live, "__iter__")
            else [operator.index(b) for b in max_live]
        )
    except TypeError:
        raise ScheduleError(
            f"max_live must be an integer or one integer per rank, got {max_live!r}"
        ) from None
    if len(budgets) != num_ranks:
        raise ScheduleError(f"max_live has {len(budgets)} entries for {num_ranks} ranks")
    return budgets


# Where a key's residuals are, along its owner's list (see `_check_residual_places`).
_NONE, _INPUT, _HERE, _EVICTED, _OFFLOADING, _OFFLOADED, _RELOADING, _FREED = range(8)
_PLACE = {
    _NONE: "not made yet (no forward has run)",
    _INPUT: "not made: {fwd} kept only its input",
    _HERE: "on the device",
    _EVICTED: "evicted to rank {partner} by {moved}",
    _OFFLOADING: "being offloaded to the host by {moved}",
    _OFFLOADED: "offloaded to the host by {moved}",
    _RELOADING: "still coming back from the host ({moved})",
    _FREED: "freed by {freed}",
}
# kind: (the places it may run in, the place after it). B frees; I keeps them for W.
_MOVES = {
    "F": ((_NONE,), _HERE),
    "FC": ((_NONE,), _INPUT),
    "RECOMPUTE": ((_INPUT,), _HERE),
    "B": ((_HERE,), _FREED),
    "I": ((_HERE,), _HERE),
    "W": ((_HERE,), _FREED),
    "EVICT": ((_HERE,), _EVICTED),
    "LOAD": ((_EVICTED,), _HERE),
    "OFFLOAD_START": ((_HERE,), _OFFLOADING),
    "OFFLOAD_END": ((_OFFLOADING,), _OFFLOADED),
    "RELOAD_START": ((_OFFLOADED,), _RELOADING),
    "RELOAD_END": ((_RELOADING,), _HERE),
}
# What must come first, by place: the action that would have moved them on.
_NEEDED = {
    ("RECOMPUTE", _NONE): "FC",
    ("LOAD", _HERE): "EVICT",
    ("OFFLOAD_END", _HERE): "OFFLOAD_START",
    ("RELOAD_START", _HERE): "OFFLOAD_START",
    ("RELOAD_START", _OFFLOADING): "OFFLOAD_END",
    ("RELOAD_END", _HERE): "RELOAD_START",
    ("RELOAD_END", _OFFLOADED): "RELOAD_START",
}
_BRINGS_BACK = {
    _INPUT: "RECOMPUTE",
    _EVICTED: "LOAD",
    _OFFLOADING: "OFFLOAD_END, RELOAD_START and RELOAD_END",
    _OFFLOADED: "RELOAD_START and RELOAD_END",
    _RELOADING: "RELOAD_END",
}


def _check_residual_places(rows, cell_pos, M: int) -> None:
    """Step 5b: each action finds its key's residuals where it needs them (module docstring)."""
    memory_kinds = frozenset(MEMORY_KINDS)
    for r, row in enumerate(rows):
        place: dict[int, int] = {}
        moved: dict[int, int] = {}  # index of the last action that put them where they are
        made: dict[int, int] = {}  # index of the key's F or FC
        for i, a in enumerate(row):
            kind = a.kind
            k = a.stage * M + a.microbatch
            here = place.get(k, _NONE)
            allowed, after = _MOVES[kind]
            if here not in allowed:
                why = _misplaced(r, row, cell_pos, i, here, moved.get(k), made.get(k))
                raise ScheduleError(why)
            if kind == "LOAD" and a.partner != row[moved[k]].partner:
                ev = row[moved[k]]
                raise ScheduleError(
                    f"{_where(r, cell_pos[r][i], a)}: loads from rank {a.partner}, but {ev!r} at "
                    f"position {cell_pos[r][moved[k]]} evicted them to rank {ev.partner}"
                )
            if kind == "F" or kind == "FC":
                made[k] = i
            if after != here or kind in memory_kinds:
                moved[k] = i
            place[k] = after


def _misplaced(r, row, cell_pos, i, here, moved, made) -> str:
    """Why `row[i]` cannot run with its residuals in `here` (see `_check_residual_places`)."""
    a = row[i]
    key = f"({a.stage},{a.microbatch})"
    where = _where(r, cell_pos[r][i], a)

    def at(j):
        return f"{row[j]!r} at position {cell_pos[r][j]}"

    need = _NEEDED.get((a.kind, here))
    if need is not None:
        later = next(
            (j for j in range(i + 1, len(row)) if row[j].kind == need and row[j].key == a.key),
            None,
        )
        if later is not None:
            return f"{where}: comes before {at(later)}, which it needs"
        return f"{where}: needs an {need} of {key} before it, and rank {r} has none"
    if here == _NONE:
        return f"{where}: comes before the forward of {key}, which it needs"
    if a.kind == "RECOMPUTE" and here in (_HERE, _FREED) and row[made].kind == "F":
        return f"{where}: nothing to recompute: {at(made)} kept its residuals (an FC drops them)"
    text = _PLACE[here].format(
        fwd=at(made) if made is not None else "its forward",
        partner=row[moved].partner if moved is not None else None,
        moved=at(moved) if moved is not None else "",
        freed=at(moved) if moved is not None else "",
    )
    reads = a.kind in ("RECOMPUTE", "B", "I", "W")
    tail = ""
    if reads and here == _INPUT:
        tail = "; a RECOMPUTE must come before it (missing recompute)"
    elif reads and here in _BRINGS_BACK:
        tail = f"; {_BRINGS_BACK[here]} must come before it"
    verb = "reads" if reads else "moves"
    return f"{where}: {verb} the residuals of {key} while they are {text}{tail}"


def _held_in_time(rows, cell_pos, order, S, M, at, budgets):
    """Live activations per rank in time (unit costs), what it holds for a partner included.

    Returns `(peak per rank, message)`, the message naming where `budgets` are
    first exceeded (or `None`).
    """
    starts, ends, issue, _ = _run(rows, order, S, M, at, Costs())
    ones = ((1.0,) * S, (0.0,) * S, (0.0,) * S)  # residuals count; inputs and carries do not
    peaks, message = [], None
    for r, events in enumerate(_live_events(rows, starts, ends, issue, S, M, len(rows), *ones)):
        live = peak = 0.0
        held = 0
        for key, delta, (src, j) in events:
            live += delta
            if src != r:
                held += 1 if delta > 0 else -1
            peak = max(peak, live)
            if budgets is not None and message is None and live > budgets[r]:
                own_pos = _position_at(starts[r], key[0])
                a = rows[r][own_pos] if own_pos is not None else None
                where = (
                    _where(r, cell_pos[r][own_pos], a) if a is not None else f"rank {r} (no action)"
                )
                extra = ""
                if held:
                    b = rows[src][j]
                    extra = (
                        f" ({held} of them held for another rank, such as {b!r} from rank "
                        f"{src}, position {cell_pos[src][j]})"
                    )
                message = (
                    f"{where}: {int(live)} live activations{extra} exceed the budget of "
                    f"{budgets[r]} on rank {r}"
                )
        peaks.append(int(peak))
    return peaks, message


def _position_at(starts, t) -> int | None:
    """The rank's action that starts last at or before `t` (else its first)."""
    best = None
    for i, s in enumerate(starts):
        if s <= t and (best is None or s >= starts[best]):
            best = i
    return best if best is not None else (0 if starts else None)


def _refuse_a_stray_microbatch(rows, cell_pos, S: int, M: int, where) -> None:
    """Names an index past the others when the count was read from the highest one.

    Where the highest microbatch, ``M - 1``, is on at most half of the stages,
    the likelier mistake is that index (PyTorch's 1F1B orders for some sizes
    have one: the last rank's forwards run 1..M instead of 0..M-1), not all
    the other stages missing a microbatch; so the error names the first
    action with it, rather than the first stage without it.
    """
    m = M - 1
    having = [s for s in range(S) if any(slots[s * M + m] is not None for slots in where.values())]
    if len(having) == S or len(having) > S - len(having):
        return
    r, i = min(slots[s * M + m] for s in having for slots in where.values() if slots[s * M + m])
    others = [s for s in range(S) if s not in having]
    shown = ", ".join(map(str, others[:8])) + (", ..." if len(others) > 8 else "")
    raise ScheduleError(
        f"{_where(r, cell_pos[r][i], rows[r][i])}: stray microbatch {m}: only stage"
        f"{'s' if len(having) > 1 else ''} {', '.join(map(str, having))} "
        f"{'have' if len(having) > 1 else 'has'} it, stage{'s' if len(others) > 1 else ''} "
        f"{shown} {'do' if len(others) > 1 else 'does'} not; the number of microbatches, "
        f"{M}, is read from the highest index, so each stage must run microbatches 0..{m}"
    )


def _walk(rows, cell_pos, S, M, at):
    """Runs every rank in list order as far as dependencies allow; O(actions)."""
    R = len(rows)
    # done[kind][s*M+m]; "G" marks the backward that sends a gradient upstream.
    done_f = bytearray(S * M)
    done_g = bytearray(S * M)  # B or I of (s, m) has run
    done_i = bytearray(S * M)
    pc = [0] * R
    waiting: dict[tuple[str, int], list[int]] = {}
    order: list[tuple[int, int]] = []
    ran = order.append
    live = [0] * R
    peak = [0] * R
    ready = list(range(R))
    last = S - 1
    while ready:
        r = ready.pop()
        row = rows[r]
        n = len(row)
        i = pc[r]
        while i < n:
            a = row[i]
            kind, s = a.kind, a.stage
            k = s * M + a.microbatch
            # Each kind waits for what it needs (then the rank stops here), or runs and
            # wakes the ranks that waited for it.
            if kind == "F" or kind == "FC":
                if s > 0 and not done_f[k - M]:
                    waiting.setdefault(("F", k - M), []).append(r)
                    break
                ran((r, i))
                done_f[k] = 1
                if kind == "F":
                    live[r] += 1
                    if live[r] > peak[r]:
                        peak[r] = live[r]
                woken = waiting.pop(("F", k), None)
            elif kind == "B" or kind == "I":
                if not done_f[k]:
                    waiting.setdefault(("F", k), []).append(r)
                    break
                if s < last and not done_g[k + M]:
                    waiting.setdefault(("G", k + M), []).append(r)
                    break
                ran((r, i))
                done_g[k] = 1
                if kind == "I":
                    done_i[k] = 1
                    woken = waiting.pop(("I", k), None)
                    other = waiting.pop(("G", k), None)
                    if other:
                        woken = (woken or []) + other
                else:
                    live[r] -= 1
                    woken = waiting.pop(("G", k), None)
            elif kind == "W":
                if not done_i[k]:
                    waiting.setdefault(("I", k), []).append(r)
                    break
                ran((r, i))
                live[r] -= 1
                woken = None
            else:  # a memory action needs only what its own rank ran before it (step 5b);
                ran((r, i))  # its peak is counted in time (_held_in_time)
                woken = None
            if woken:
                ready.extend(woken)
            i += 1
        pc[r] = i
    if len(order) != sum(len(row) for row in rows):
        raise ScheduleError(_deadlock_message(rows, cell_pos, pc, S, M, at))
    return order, peak


def _deadlock_message(rows, cell_pos, pc, S, M, at) -> str:
    """Each stuck rank's blocked action and what it waits for; `at` is each key's rank."""
    lines = ["deadlock: no rank can make progress."]
    for r, row in enumerate(rows):
        if pc[r] >= len(row):
            continue
        a = row[pc[r]]
        s, m = a.stage, a.microbatch
        if a.kind in ("F", "FC"):
            deps = [Action("F", s - 1, m), Action("FC", s - 1, m)]
        elif a.kind == "W":
            deps = [Action("I", s, m)]
        elif not _ran_before(rows, pc, at[s * M + m], Action("F", s, m)) and not _ran_before(
            rows, pc, at[s * M + m], Action("FC", s, m)
        ):
            deps = [Action("F", s, m), Action("FC", s, m)]
        else:
            deps = [Action("B", s + 1, m), Action("I", s + 1, m)]
        dep_rank = at[deps[0].stage * M + m]
        dep_row = rows[dep_rank]
        dep_pos = next((i for i, b in enumerate(dep_row) if b in deps), None)
        dep = deps[0] if dep_pos is None else dep_row[dep_pos]
        if len(deps) == 1 or dep_pos is not None:
            name = repr(dep)
        elif deps[0].kind == "F":
            name = f"the forward of ({deps[0].stage},{m})"
        else:
            name = f"the backward of ({s + 1},{m})"
        if dep_rank == r and dep_pos is not None:
            where = f"which comes later on this rank, at position {cell_pos[r][dep_pos]}"
        else:
            where = f"on rank {dep_rank}"
            if pc[dep_rank] < len(dep_row):
                blocker = dep_row[pc[dep_rank]]
                where += (
                    f", which is itself stuck at position {cell_pos[dep_rank][pc[dep_rank]]} "
                    f"({blocker!r})"
                )
        lines.append(f"  {_where(r, cell_pos[r][pc[r]], a)} waits for {name} {where}")
    return "\n".join(lines)


def _ran_before(rows, pc, rank, action) -> bool:
    return action in rows[rank][: pc[rank]]
