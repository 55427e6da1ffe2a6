"""The event engine: a schedule's actions run in time, and the live memory that follows.

`Costs` (the time each kind of action takes), `_run` (each action's start and
end, given a dependency order) and `_live_events` (each rank's changes of live
bytes in time order) are what both the simulator (`jpipe.schedule.simulate`, whose
module docstring says what is modelled) and validation (`jpipe.schedule.validate`,
which places what a rank holds for a partner in time, with unit costs) read.
They are here, below both, so that validation needs nothing from the simulator.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Sequence

Number = float | int
PerStage = Number | Sequence[Number]


def _check_values(obj, names: tuple[str, ...], word: str, allow_none: bool = False) -> None:
    """Lists become tuples; every value must be finite and non-negative (or None, if allowed)."""
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, list):
            value = tuple(value)
            object.__setattr__(obj, name, value)
        for v in value if isinstance(value, tuple) else (value,):
            if (v is not None or not allow_none) and (
                not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0
            ):
                raise ValueError(f"{word} {name} must be a finite non-negative number, got {v!r}")


def _parse_items(text: str, keys: tuple[str, ...], word: str, unit: str) -> dict[str, float]:
    """``"K=V,K=V"`` into ``{K: float(V)}``, refusing unknown keys and non-numbers."""
    kwargs = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in keys:
            raise ValueError(
                f"cannot read {word} {item!r}: expected KEY=VALUE with KEY one of {', '.join(keys)}"
            )
        try:
            kwargs[key] = float(value)
        except ValueError:
            raise ValueError(f"{word} {key} must be {unit}, got {value!r}") from None
    return kwargs


def _per_stage(word: str, name: str, value, num_stages: int) -> tuple[float, ...]:
    """One value per stage, from one value for all or a tuple of exactly `num_stages`."""
    if isinstance(value, tuple):
        if len(value) != num_stages:
            raise ValueError(
                f"{word} {name} has {len(value)} values but the schedule has {num_stages} stages"
            )
        return tuple(float(v) for v in value)
    return (float(value),) * num_stages


@dataclasses.dataclass(frozen=True)
class Costs:
    """Time each kind of action takes, one value for all stages or one per stage.

    Attributes:
      F, I, W: forward, input-gradient and weight-gradient costs.
      B: full-backward cost; `None` means ``I + W``.
      comm: latency of a transfer between two different ranks.
      recompute: a ``RECOMPUTE``'s cost; `None` means ``F`` (an ``FC`` costs ``F``).
      evict, load: moving one microbatch's residuals to the partner and back
        (`None` for `load` means `evict`); they run beside the compute.
      offload, reload: copying them to the host and back (`None` for
        `reload` means `offload`); beside the compute too.
      sync: summing a replicated stage's gradients over the ranks that hold
        it (Chimera's all-reduce), once per step and stage, beside the compute.
    """

    F: PerStage = 1
    I: PerStage = 1
    W: PerStage = 1
    B: PerStage | None = None
    comm: PerStage = 0
    recompute: PerStage | None = None
    evict: PerStage = 0
    load: PerStage | None = None
    offload: PerStage = 0
    reload: PerStage | None = None
    sync: PerStage = 0

    _KEYS = (
        "F", "I", "W", "B", "comm", "recompute", "evict", "load", "offload", "reload", "sync",
    )  # fmt: skip

    def __post_init__(self):
        _check_values(self, self._KEYS, "cost", allow_none=True)

    @classmethod
    def parse(cls, text: str) -> Costs:
        """Reads ``"F=1,I=1,W=1,B=2,comm=0"`` (and the memory actions' keys); all optional."""
        return cls(**_parse_items(text, cls._KEYS, "cost", "a number"))

    def memory_table(self, num_stages: int) -> dict[str, tuple[float, ...]]:
        """Per-stage costs of the memory actions, `{kind: (stage 0, ...)}`.

        ``FC`` and ``RECOMPUTE`` run on the compute; the transfers
        (``EVICT``, ``LOAD``, ``OFFLOAD_START``, ``RELOAD_START``) beside it; the
        ends take no time of their own.
        """

        def per_stage(name, value):
            return _per_stage("cost", name, value, num_stages)

        f = per_stage("F", self.F)
        evict = per_stage("evict", self.evict)
        offload = per_stage("offload", self.offload)
        zero = (0.0,) * num_stages
        return {
            "FC": f,
            "RECOMPUTE": f if self.recompute is None else per_stage("recompute", self.recompute),
            "EVICT": evict,
            "LOAD": evict if self.load is None else per_stage("load", self.load),
            "OFFLOAD_START": offload,
            "RELOAD_START": offload if self.reload is None else per_stage("reload", self.reload),
            "OFFLOAD_END": zero,
            "RELOAD_END": zero,
        }

    def table(self, num_stages: int) -> dict[str, tuple[float, ...]]:
        """Per-stage costs, `{kind: (cost of stage 0, cost of stage 1, ...)}`."""

        def per_stage(name, value):
            return _per_stage("cost", name, value, num_stages)

        f = per_stage("F", self.F)
        i = per_stage("I", self.I)
        w = per_stage("W", self.W)
        b = tuple(x + y for x, y in zip(i, w)) if self.B is None else per_stage("B", self.B)
        return {"F": f, "I": i, "W": w, "B": b}

    def sync_table(self, num_stages: int) -> tuple[float, ...]:
        """Per stage, the time to sum its gradients over its replicas (`sync`)."""
        return _per_stage("cost", "sync", self.sync, num_stages)

    def comm_table(self, num_stages: int) -> tuple[float, ...]:
        """Transfer latency across each boundary, stage ``s`` to ``s + 1`` (``S - 1`` values)."""
        if isinstance(self.comm, tuple):
            if len(self.comm) != num_stages - 1:
                raise ValueError(
                    f"cost comm has {len(self.comm)} values but a schedule of {num_stages} "
                    f"stages has {num_stages - 1} boundaries"
                )
            return tuple(float(v) for v in self.comm)
        return (float(self.comm),) * max(num_stages - 1, 0)


CostsGiven = Costs | Sequence[Costs]


def rank_costs(costs: CostsGiven, num_ranks: int) -> tuple[Costs, ...]:
    """One `Costs` per rank: `costs` itself for every rank, or the sequence given (one
    per rank, for ranks whose devices differ, where a replicated stage's copies run at
    different speeds). The transfers' latency (``comm``) and the replicas' gradient sum
    (``sync``) belong to the links between ranks, so every rank's `Costs` must give the
    same ones."""
    if isinstance(costs, Costs):
        return (costs,) * num_ranks
    each = tuple(costs)
    if len(each) != num_ranks or not all(isinstance(c, Costs) for c in each):
        raise ValueError(
            f"costs per rank must be one Costs for each of the schedule's {num_ranks} ranks, "
            f"got {len(each)} values"
        )
    for r, c in enumerate(each[1:], 1):
        for name in ("comm", "sync"):
            if getattr(c, name) != getattr(each[0], name):
                raise ValueError(
                    f"rank {r}'s costs give {name}={getattr(c, name)!r} but rank 0's "
                    f"{getattr(each[0], name)!r}: {name} is a cost of the links between "
                    "ranks, the same in every rank's Costs"
                )
    return each


def _run(rows, order, S: int, M: int, at, costs: CostsGiven):
    """Times every action in `order` (a dependency order, `Analysis.order`).

    Returns `(starts, ends, issue, busy)`: per rank, each action's start and end
    (a transfer's span for the transfers), the time its rank reached it in its
    list, and the rank's busy (compute) time. `at` is the rank of each `(stage,
    microbatch)` (`Analysis.key_rank`): a dependency on another rank adds the transfer.
    `costs` is one `Costs` for every rank or one per rank (`rank_costs`).
    """
    R = len(rows)
    each = rank_costs(costs, R)
    memory = any(a.kind not in ("F", "I", "W", "B") for row in rows for a in row)
    tables: dict[int, dict] = {}  # by id: one table per distinct Costs
    for c in each:
        if id(c) not in tables:
            table = c.table(S)
            tables[id(c)] = {**table, **c.memory_table(S)} if memory else table
    per_rank = [tables[id(c)] for c in each]
    comm = each[0].comm_table(S)
    end_f = [0.0] * (S * M)
    end_g = [0.0] * (S * M)  # end of the B or I of (s, m)
    end_i = [0.0] * (S * M)
    readable = [0.0] * (S * M)  # when the residuals can be read on their rank
    away = [0.0] * (S * M)  # when the eviction or offload of (s, m) ended
    free = [0.0] * R  # the rank's compute (and its place in its list)
    link = [0.0] * R  # its transfers to and from its partner
    host = [0.0] * R  # its copies to and from the host
    busy = [0.0] * R
    starts = [[0.0] * len(row) for row in rows]
    ends = [[0.0] * len(row) for row in rows]
    issue = [[0.0] * len(row) for row in rows]
    last = S - 1
    for r, i in order:
        a = rows[r][i]
        s, kind = a.stage, a.kind
        k = s * M + a.microbatch
        ready = issue[r][i] = free[r]
        duration = per_rank[r][kind][s]
        # when it can start, and what its end makes ready
        if kind == "F" or kind == "FC":
            if s > 0:
                after = end_f[k - M] + (comm[s - 1] if at[k - M] != r else 0.0)
                if after > ready:
                    ready = after
            finish = ready + duration
            free[r] = finish
            busy[r] += duration
            end_f[k] = readable[k] = finish
        elif kind == "B" or kind == "I":
            ready = max(ready, end_f[k], readable[k])
            if s < last:
                ready = max(ready, end_g[k + M] + (comm[s] if at[k + M] != r else 0.0))
            finish = ready + duration
            free[r] = finish
            busy[r] += duration
            end_g[k] = finish
            if kind == "I":
                end_i[k] = finish
        elif kind == "W":
            ready = max(ready, end_i[k], readable[k])
            finish = ready + duration
            free[r] = finish
            busy[r] += duration
        elif kind == "RECOMPUTE":
            ready = max(ready, readable[k])
            finish = ready + duration
            free[r] = finish
            busy[r] += duration
            readable[k] = finish
        elif kind == "EVICT" or kind == "LOAD":
            if kind == "EVICT":
                ready = max(ready, link[r], 0.0)
                finish = away[k] = ready + duration
            else:
                ready = max(ready, link[r], away[k])
                finish = readable[k] = ready + duration
            link[r] = finish
        elif kind == "OFFLOAD_START" or kind == "RELOAD_START":
            if kind == "OFFLOAD_START":
                ready = max(ready, host[r], 0.0)
                finish = away[k] = ready + duration
            else:
                ready = max(ready, host[r], away[k])
                finish = readable[k] = ready + duration
            host[r] = finish
        else:  # OFFLOAD_END, RELOAD_END: the rank waits for its copy
            ready = max(ready, away[k] if kind == "OFFLOAD_END" else readable[k])
            finish = free[r] = ready + duration
        starts[r][i], ends[r][i] = ready, finish
    return starts, ends, issue, busy


def _live_events(rows, starts, ends, issue, S, M, R, act, inp, carry):
    """Per rank, its changes of live bytes in time order: `(key, delta, (rank, index))`.

    `act`, `inp` and `carry` give each stage's residual, kept-input and carry
    sizes. The rank's own changes are ordered as its list runs them; at one
    instant what it takes for a partner comes before them and what it gives
    back after them (the larger count, where times tie). See the module docstring.
    """
    events: list[list] = [[] for _ in range(R)]
    # at a start: (start, 1, i, 0); at an end: (end, 1, i, 1); a partner's (t, 0 or 2, r, i)
    for r, row in enumerate(rows):
        add = events[r].append
        t0s, t1s = starts[r], ends[r]
        for i, a in enumerate(row):
            s, kind = a.stage, a.kind
            if kind == "F":
                add(((t0s[i], 1, i, 0), act[s], (r, i)))
            elif kind == "W":
                add(((t1s[i], 1, i, 1), -act[s] - carry[s], (r, i)))
            elif kind == "I":
                add(((t0s[i], 1, i, 0), carry[s], (r, i)))
            elif kind == "B":
                add(((t1s[i], 1, i, 1), -act[s], (r, i)))
            elif kind == "FC":
                add(((t0s[i], 1, i, 0), inp[s], (r, i)))
            elif kind == "RECOMPUTE":
                add(((t0s[i], 1, i, 0), act[s], (r, i)))
                add(((t1s[i], 1, i, 1), -inp[s], (r, i)))
            elif kind == "EVICT":
                add(((t1s[i], 1, i, 1), -act[s], (r, i)))
                events[a.partner].append(((t0s[i], 0, r, i), act[s], (r, i)))
            elif kind == "LOAD":
                add(((t0s[i], 1, i, 0), act[s], (r, i)))
                events[a.partner].append(((t1s[i], 2, r, i), -act[s], (r, i)))
            elif kind == "OFFLOAD_END":
                add(((t1s[i], 1, i, 1), -act[s], (r, i)))
            elif kind == "RELOAD_START":
                add(((t0s[i], 1, i, 0), act[s], (r, i)))
    first = operator.itemgetter(0)
    for row in events:
        row.sort(key=first)
    return events
