"""Validation: is this schedule complete, consistent and free of deadlock?

`validate` checks, in this order, and stops at the first problem with a
`ScheduleError` that names the rank, the position in its list, the action, and
what is wrong:

1. indices: stages and microbatches are non-negative (and below the expected
   counts, when given);
2. placement: every stage lives on exactly one rank;
3. duplicates: no action appears twice;
4. completeness: every `(stage, microbatch)` has one `F` and either one `B` or
   one `I` and one `W`, and no stage or microbatch is missing;
5. order on a rank: a backward after its own forward, a `W` after its `I`;
6. deadlock: the ranks are run as a dependency graph (each rank in its list
   order, an action waiting for the actions it depends on); if they get stuck,
   the message names the blocked action on every stuck rank and what it waits
   for. The walk visits each action once, so it never hangs;
7. optionally, a budget of live activations per rank.

Dependencies: ``F(s,m)`` after ``F(s-1,m)``; the backward of ``(s,m)`` (``B`` or
``I``) after ``F(s,m)`` and after the backward of ``(s+1,m)``; ``W(s,m)`` after
``I(s,m)``.

The walk also yields the order in which actions can run, which the simulator
and the compiler's planner reuse.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jpipe._schedule import Action, Schedule


class ScheduleError(ValueError):
    """A schedule that cannot run; the message says where and why."""


def _where(rank: int, pos: int, action) -> str:
    return f"rank {rank}, position {pos} ({action!r})"


@dataclasses.dataclass(frozen=True)
class Analysis:
    """What validation learned; used by the simulator and the planner.

    Attributes:
      num_stages, num_microbatches: the schedule's sizes.
      stage_to_rank: the rank of each stage.
      order: every plain action as `(rank, index)` in an order that respects
        all dependencies, `index` counting the rank's plain actions
        (`Schedule.actions`).
      peak_live: the most live activations on each rank.
    """

    num_stages: int
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    order: tuple[tuple[int, int], ...]
    peak_live: tuple[int, ...]


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
    """Like `validate`, but returns what it learned (see `Analysis`)."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"expected a jpipe.Schedule, got {type(schedule).__name__}")
    rows = [schedule.actions(r) for r in range(schedule.num_ranks)]
    # Position in the rank's row as written (an Overlap cell is one position).
    cell_pos = []
    for row in schedule.ranks:
        cell_pos.append([pos for pos, step in enumerate(row) for _ in step.parts])
    if not any(rows):
        raise ScheduleError("the schedule has no actions")

    # 1. indices
    for r, row in enumerate(rows):
        for i, a in enumerate(row):
            if a.stage < 0 or a.microbatch < 0:
                raise ScheduleError(
                    f"{_where(r, cell_pos[r][i], a)}: stage and microbatch must be >= 0"
                )
            if num_stages is not None and a.stage >= num_stages:
                raise ScheduleError(
                    f"{_where(r, cell_pos[r][i], a)}: stage {a.stage} is out of range; "
                    f"the model has {num_stages} stages (0..{num_stages - 1})"
                )
            if num_microbatches is not None and a.microbatch >= num_microbatches:
                raise ScheduleError(
                    f"{_where(r, cell_pos[r][i], a)}: microbatch {a.microbatch} is out of "
                    f"range; there are {num_microbatches} microbatches (0..{num_microbatches - 1})"
                )
    S = num_stages if num_stages is not None else schedule.num_stages
    M = num_microbatches if num_microbatches is not None else schedule.num_microbatches

    # 2. placement, 3. duplicates
    owner: list[int] = [-1] * S
    first_seen: dict[Action, tuple[int, int]] = {}
    for r, row in enumerate(rows):
        for i, a in enumerate(row):
            o = owner[a.stage]
            if o == -1:
                owner[a.stage] = r
            elif o != r:
                raise ScheduleError(
                    f"{_where(r, cell_pos[r][i], a)}: stage {a.stage} is on two ranks, "
                    f"{o} and {r}; a stage must live on exactly one rank"
                )
            prev = first_seen.get(a)
            if prev is not None:
                raise ScheduleError(
                    f"{_where(r, cell_pos[r][i], a)}: duplicate; {a!r} already appears "
                    f"at rank {prev[0]}, position {cell_pos[prev[0]][prev[1]]}"
                )
            first_seen[a] = (r, i)

    # 4. completeness
    for s in range(S):
        if owner[s] == -1:
            raise ScheduleError(f"stage {s} appears on no rank; stages 0..{S - 1} must all be scheduled")
    kinds_of: dict[tuple[int, int], set[str]] = {}
    for a in first_seen:
        kinds_of.setdefault(a.key, set()).add(a.kind)
    for m in range(M):
        if not any((s, m) in kinds_of for s in range(S)):
            raise ScheduleError(
                f"microbatch {m} is missing: no rank has an action for it "
                f"(microbatches 0..{M - 1} must all be scheduled)"
            )
    for s in range(S):
        r = owner[s]
        for m in range(M):
            kinds = kinds_of.get((s, m), set())
            problem = None
            if "F" not in kinds:
                problem = f"F({s},{m}) is missing"
            elif "B" in kinds and ("I" in kinds or "W" in kinds):
                problem = f"({s},{m}) has both a B and an I/W backward; use one or the other"
            elif "I" in kinds and "W" not in kinds:
                problem = f"I({s},{m}) has no matching W({s},{m})"
            elif "W" in kinds and "I" not in kinds:
                problem = f"W({s},{m}) has no matching I({s},{m})"
            elif not kinds & {"B", "I"}:
                problem = f"the backward of ({s},{m}) is missing: add B({s},{m}) or I({s},{m}) and W({s},{m})"
            if problem:
                raise ScheduleError(f"rank {r} (which holds stage {s}): {problem}")

    # 5. order on one rank
    for r, row in enumerate(rows):
        pos_of = {a: i for i, a in enumerate(row)}
        for i, a in enumerate(row):
            before = None
            if a.kind in ("B", "I"):
                before = Action("F", a.stage, a.microbatch)
            elif a.kind == "W":
                before = Action("I", a.stage, a.microbatch)
            if before is not None and pos_of[before] > i:
                raise ScheduleError(
                    f"{_where(r, cell_pos[r][i], a)}: comes before {before!r} at position "
                    f"{cell_pos[r][pos_of[before]]}, which it needs"
                )

    # 6. deadlock: walk the dependency graph
    order, peak = _walk(rows, cell_pos, S, M, owner)

    # 7. live-activation budget
    if max_live is not None:
        budgets = [max_live] * len(rows) if isinstance(max_live, int) else list(max_live)
        if len(budgets) != len(rows):
            raise ScheduleError(f"max_live has {len(budgets)} entries for {len(rows)} ranks")
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
    return Analysis(S, M, tuple(owner), tuple(order), tuple(peak))


def _walk(rows, cell_pos, S, M, owner):
    """Runs every rank in list order as far as dependencies allow; O(actions)."""
    R = len(rows)
    # done[kind][s*M+m]; "G" marks the backward that sends a gradient upstream.
    done_f = bytearray(S * M)
    done_g = bytearray(S * M)  # B or I of (s, m) has run
    done_i = bytearray(S * M)
    pc = [0] * R
    waiting: dict[tuple[str, int], list[int]] = {}
    order: list[tuple[int, int]] = []
    live = [0] * R
    peak = [0] * R
    ready = list(range(R))
    while ready:
        r = ready.pop()
        row = rows[r]
        i = pc[r]
        while i < len(row):
            a = row[i]
            s, m = a.stage, a.microbatch
            k = s * M + m
            need = None
            if a.kind == "F":
                if s > 0 and not done_f[k - M]:
                    need = ("F", k - M)
            elif a.kind == "W":
                if not done_i[k]:
                    need = ("I", k)
            else:  # B or I
                if not done_f[k]:
                    need = ("F", k)
                elif s < S - 1 and not done_g[k + M]:
                    need = ("G", k + M)
            if need is not None:
                waiting.setdefault(need, []).append(r)
                break
            order.append((r, i))
            if a.kind == "F":
                done_f[k] = 1
                live[r] += 1
                if live[r] > peak[r]:
                    peak[r] = live[r]
                woken = waiting.pop(("F", k), None)
            elif a.kind == "W":
                live[r] -= 1
                woken = None
            else:
                done_g[k] = 1
                if a.kind == "I":
                    done_i[k] = 1
                    woken = waiting.pop(("I", k), None)
                    other = waiting.pop(("G", k), None)
                    if other:
                        woken = (woken or []) + other
                else:
                    live[r] -= 1
                    woken = waiting.pop(("G", k), None)
            if woken:
                ready.extend(woken)
            i += 1
        pc[r] = i
    if len(order) != sum(len(row) for row in rows):
        raise ScheduleError(_deadlock_message(rows, cell_pos, pc, S, M, owner))
    return order, peak


def _deadlock_message(rows, cell_pos, pc, S, M, owner) -> str:
    lines = ["deadlock: no rank can make progress."]
    for r, row in enumerate(rows):
        if pc[r] >= len(row):
            continue
        a = row[pc[r]]
        s, m = a.stage, a.microbatch
        if a.kind == "F":
            dep = f"F({s - 1},{m})"
            dep_stage = s - 1
        elif a.kind == "W":
            dep, dep_stage = f"I({s},{m})", s
        elif not _ran_before(rows, pc, owner[s], Action("F", s, m)):
            dep, dep_stage = f"F({s},{m})", s
        else:
            dep, dep_stage = f"the backward of ({s + 1},{m})", s + 1
        dep_rank = owner[dep_stage]
        where = f"on rank {dep_rank}"
        dep_row = rows[dep_rank]
        blocker = dep_row[pc[dep_rank]] if pc[dep_rank] < len(dep_row) else None
        if blocker is not None:
            where += f", which is itself stuck at position {cell_pos[dep_rank][pc[dep_rank]]} ({blocker!r})"
        lines.append(f"  {_where(r, cell_pos[r][pc[r]], a)} waits for {dep} {where}")
    return "\n".join(lines)


def _ran_before(rows, pc, rank, action) -> bool:
    return action in rows[rank][: pc[rank]]
