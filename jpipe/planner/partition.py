"""Partitioning: split an ordered list of layers into contiguous stages.

Given the time of every layer on the device of every stage (``cost[s][l]``: a
stage's time is the sum over its layers, so mixed devices are a different row
per stage) and, optionally, a memory check per stage, `partition` returns the
contiguous split that minimises the slowest stage (the bottleneck). It is exact:
a dynamic programme over (stages used, layers placed) where

    best[s][j] = min over i < j of max(best[s-1][i], time of layers i..j-1 on stage s-1)

keeping only splits whose every stage passes the memory check, so memory is a
hard limit and the result is provably optimal for the bottleneck (a better
prefix never makes a worse whole, since ``max`` is monotone). Among prefixes
with equal bottlenecks the DP keeps the smaller total time, a tie-break that
is greedy, not a guarantee of the least total. The cost is
O(S * L^2) additions, a few milliseconds for the 26 to 50 layers of the
models we plan.

`uniform_partition` (equal layer counts) and `proportional_partition` (layer
counts proportional to device speed) are the baselines that planners without
a search use.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence

# fits(stage, first_layer, end_layer) -> bool: do layers [first, end) fit on the stage's device?
MemoryCheck = Callable[[int, int, int], bool]
# extra(stage, first_layer, end_layer) -> seconds a stage spends beyond its layers (its transfers).
ExtraCost = Callable[[int, int, int], float]


class NoSplitFits(ValueError):
    """No contiguous split of the layers over the stages fits in the devices' memory."""


@dataclasses.dataclass(frozen=True)
class Partition:
    """A contiguous split of layers into stages.

    Attributes:
      layers: the layer indices of each stage, in order.
      stage_times: the time of each stage (sum of its layers' costs on its device).
      bottleneck: the slowest stage's time.
    """

    layers: tuple[tuple[int, ...], ...]
    stage_times: tuple[float, ...]
    bottleneck: float

    @property
    def sizes(self) -> tuple[int, ...]:
        """Layers per stage."""
        return tuple(len(x) for x in self.layers)

    def to_json(self) -> dict:
        return {
            "partition": [list(x) for x in self.layers],
            "stage_times": list(self.stage_times),
            "bottleneck": self.bottleneck,
        }


def _check_costs(cost: Sequence[Sequence[float]]) -> tuple[tuple[float, ...], ...]:
    rows = tuple(tuple(float(c) for c in row) for row in cost)
    if not rows:
        raise ValueError("partition needs at least one stage")
    num_layers = len(rows[0])
    for s, row in enumerate(rows):
        if len(row) != num_layers:
            raise ValueError(
                f"stage {s} has costs for {len(row)} layers but stage 0 has {num_layers}"
            )
        for v in row:
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"layer costs must be finite and non-negative, got {v!r}")
    if num_layers < len(rows):
        raise ValueError(
            f"cannot split {num_layers} layers into {len(rows)} stages: every stage needs a layer"
        )
    return rows


def _make(rows, cuts, extra=None) -> Partition:
    layers = tuple(tuple(range(a, b)) for a, b in zip(cuts[:-1], cuts[1:]))
    times = tuple(
        sum(rows[s][a:b]) + (extra(s, a, b) if extra else 0.0)
        for s, (a, b) in enumerate(zip(cuts[:-1], cuts[1:]))
    )
    return Partition(layers, times, max(times))


def partition(
    cost: Sequence[Sequence[float]],
    fits: MemoryCheck | None = None,
    extra: ExtraCost | None = None,
) -> Partition:
    """The contiguous split minimising the slowest stage (exact; see the module docstring).

    Args:
      cost: ``cost[s][l]``, the time of layer ``l`` on stage ``s``'s device.
      fits: ``fits(s, first, end)`` says whether layers ``[first, end)`` fit in
        stage ``s``'s memory; `None` means no limit.
      extra: ``extra(s, first, end)``, seconds stage ``s`` spends beyond its
        layers' sum, such as sending its output (the DP is exact for any
        stage cost, additive or not).

    Returns:
      The optimal `Partition`.

    Raises:
      ValueError: bad costs or fewer layers than stages; `NoSplitFits` (a
        `ValueError`) where no split fits in memory.
    """
    rows = _check_costs(cost)
    S, L = len(rows), len(rows[0])
    prefix = [list(itertools.accumulate(row, initial=0.0)) for row in rows]
    inf = (math.inf, math.inf)
    # best[s][j]: (bottleneck, total) of the best split of layers [0, j) over stages [0, s).
    best = [[inf] * (L + 1) for _ in range(S + 1)]
    cut = [[-1] * (L + 1) for _ in range(S + 1)]
    best[0][0] = (0.0, 0.0)
    for s in range(1, S + 1):
        row = prefix[s - 1]
        # Stage s-1 takes layers [i, j); the stages after it need a layer each.
        for j in range(s, L - (S - s) + 1):
            here, where = inf, -1
            for i in range(s - 1, j):
                prev = best[s - 1][i]
                if prev[0] == math.inf:
                    continue
                t = row[j] - row[i] + (extra(s - 1, i, j) if extra else 0.0)
                if fits is not None and not fits(s - 1, i, j):
                    continue
                cand = (max(prev[0], t), prev[1] + t)
                if cand < here:
                    here, where = cand, i
            best[s][j], cut[s][j] = here, where
    if best[S][L][0] == math.inf:
        raise NoSplitFits(
            f"no split of {L} layers into {S} stages fits in the devices' memory; "
            "use more stages, more tensor parallelism, or smaller microbatches"
        )
    cuts = [L]
    for s in range(S, 0, -1):
        cuts.append(cut[s][cuts[-1]])
    return _make(rows, cuts[::-1], extra)


def brute_force_partition(
    cost: Sequence[Sequence[float]],
    fits: MemoryCheck | None = None,
    extra: ExtraCost | None = None,
) -> Partition:
    """Every contiguous split tried; the reference `partition` is tested against."""
    rows = _check_costs(cost)
    S, L = len(rows), len(rows[0])
    best = None
    for inner in itertools.combinations(range(1, L), S - 1):
        cuts = (0, *inner, L)
        if fits is not None and not all(
            fits(s, a, b) for s, (a, b) in enumerate(zip(cuts[:-1], cuts[1:]))
        ):
            continue
        p = _make(rows, cuts, extra)
        if best is None or p.bottleneck < best.bottleneck:
            best = p
    if best is None:
        raise NoSplitFits(f"no split of {L} layers into {S} stages fits in the devices' memory")
    return best


def speed_costs(layer_costs: Sequence[float], speeds: Sequence[float]) -> list[list[float]]:
    """``cost[s][l] = layer_costs[l] / speeds[s]``: layer times on devices of relative speed."""
    for v in speeds:
        if not math.isfinite(v) or v <= 0:
            raise ValueError(f"speeds must be positive numbers, got {v!r}")
    return [[c / v for c in layer_costs] for v in speeds]


def _from_sizes(rows, sizes) -> Partition:
    return _make(rows, list(itertools.accumulate(sizes, initial=0)))


def uniform_partition(cost: Sequence[Sequence[float]]) -> Partition:
    """Baseline: equal layer counts (the first stages take one more when it does not divide)."""
    rows = _check_costs(cost)
    S, L = len(rows), len(rows[0])
    return _from_sizes(rows, [L // S + (s < L % S) for s in range(S)])


def proportional_partition(cost: Sequence[Sequence[float]]) -> Partition:
    """Baseline: layer counts proportional to each stage's speed (1 / its total layer time).

    Counts are rounded by largest remainder with at least one layer per stage.
    """
    rows = _check_costs(cost)
    S, L = len(rows), len(rows[0])
    speed = [1.0 / sum(row) if sum(row) > 0 else 1.0 for row in rows]
    share = [L * v / sum(speed) for v in speed]
    sizes = [max(1, math.floor(x)) for x in share]
    order = sorted(range(S), key=lambda s: share[s] - math.floor(share[s]), reverse=True)
    k = 0
    while sum(sizes) < L:
        sizes[order[k % S]] += 1
        k += 1
    while sum(sizes) > L:  # only when rounding up to one layer overshot
        s = max((s for s in range(S) if sizes[s] > 1), key=lambda s: sizes[s] - share[s])
        sizes[s] -= 1
    return _from_sizes(rows, sizes)
