"""V-shaped schedules from a repeated building block (Qi et al., 2024), shared by vhalf and vmin.

"Pipeline Parallelism with Controllable Memory" (Qi, Wan, Amar, Lin;
NeurIPS 2024) builds a schedule by laying out the passes of one microbatch
(the building block), repeating it every few units of time and squeezing out
the gaps. How long a stage's residuals live in the block (from its F to its
W) fixes how many microbatches a rank holds at once, so memory is chosen by
choosing the block. This module writes such a block for the V placement (rank
r holds stages r and 2R - 1 - r, as in zbv) and turns it into each rank's list:

1. **Block.** With unit passes (F = I = W = 1), one microbatch goes down the
   ranks through F(0) .. F(R-1), back up through F(R) .. F(2R-1), then its
   input gradients retrace the path, I(2R-1) .. I(0); each W follows its I.
   Every rank runs six passes a microbatch, so the block repeats every
   ``PERIOD = 6`` units, and the six passes of a rank must fall in six
   different slots modulo 6 or two microbatches would collide. Each pass
   along the path starts at the first free slot no earlier than its input's
   end plus its ``slack``, and each W at the first free slot after its I.
   With no slack every residual lives as briefly as the V allows (vmin); one
   unit of slack on every other pass makes the block half as long again and
   spends that memory on the warm-up (vhalf).
2. **Repeat.** Microbatch m's passes start 6m units after microbatch 0's;
   each rank's list is its passes in order of start time. A rank's peak in
   this steady state, counted as jpipe counts it (+1 at F, -1 at W), is its
   memory cap.
3. **Fill.** The repeated lists leave ranks idle in the warm-up and the
   cool-down, where they hold less than their cap. A unit-time list schedule
   runs each rank's list in order; where the next action is not ready, it
   runs the first ready one further down instead, a forward only if moving
   it up keeps the rank at or below its cap until the forward's old place.
   Once a rank has no forwards left, a ready I goes before a W that is next
   (as in zbv's cool-down), so the input gradients that the upstream ranks
   wait for are not held up by weight gradients.

The lists are fixed for F = I = W; other costs run the same lists in the
simulator and the compiler, only with more bubble.
"""

from collections import deque
from itertools import islice

from jpipe import F, I, W

PERIOD = 6  # a rank's passes per microbatch: F, I and W of each of its two stages


def v_shape_rows(num_ranks, num_microbatches, slack):
    """Each rank's list for the block whose path passes wait `slack(k)` extra units.

    Args:
      num_ranks: R; the schedule has 2R stages, stage s on rank s for s < R and
        on rank 2R - 1 - s otherwise.
      num_microbatches: M >= 1.
      slack: a function of k, the pass's position on the microbatch's path
        (0 for F(0), 2R for I(2R-1), 4R - 1 for I(0)), giving how many units
        beyond its input's end the pass waits at least.
    """
    R, M = num_ranks, num_microbatches
    start = _block(R, slack)
    rows = []
    for r in range(R):
        mine = [(kind, s) for (kind, s) in start if _rank_of(R, s) == r]
        passes = [(start[k, s] + PERIOD * m, k, s, m) for k, s in mine for m in range(M)]
        rows.append([(k, s, m) for _, k, s, m in sorted(passes)])
    caps = [_steady_peak(start, (r, 2 * R - 1 - r)) for r in range(R)]
    return _fill(R, rows, caps)


def _rank_of(R, s):
    return s if s < R else 2 * R - 1 - s


_ACTION = {"F": F, "I": I, "W": W}


def _block(R, slack):
    """Start times of microbatch 0's passes, ``{(kind, stage): time}``, in unit passes."""
    S = 2 * R
    taken = [set() for _ in range(R)]  # slots modulo PERIOD in use on each rank
    start = {}

    def place(kind, s, earliest):
        r, t = _rank_of(R, s), earliest
        while t % PERIOD in taken[r]:
            t += 1
        taken[r].add(t % PERIOD)
        start[kind, s] = t
        return t

    path = [("F", s) for s in range(S)] + [("I", s) for s in reversed(range(S))]
    ready = 0  # when the previous pass on the path ends
    for k, (kind, s) in enumerate(path):
        ready = place(kind, s, ready + (slack(k) if k else 0)) + 1
    for s in reversed(range(S)):
        place("W", s, start["I", s] + 1)
    return start


def _steady_peak(start, stages):
    """Most live activations on a rank whose `stages` repeat `start` every PERIOD units.

    Stage s's microbatch m is live over [F, W + 1); at time x the number of m
    with ``f + PERIOD m <= x < f + life + PERIOD m`` is a difference of floors,
    the same for x and x + PERIOD, so the six slots of one period tell all.
    """
    peak = 0
    for x in range(PERIOD):
        live = 0
        for s in stages:
            f, life = start["F", s], start["W", s] + 1 - start["F", s]
            live += (x - f) // PERIOD - (x - f - life) // PERIOD
        peak = max(peak, live)
    return peak


def _fill(R, rows, caps):
    """Runs `rows` as a unit-time list schedule that fills idle slots (step 3 above).

    `rows` hold ``(kind, stage, microbatch)`` tuples; the result holds actions.
    """
    S = 2 * R
    pending = [deque(row) for row in rows]
    forwards_left = [sum(kind == "F" for kind, _, _ in row) for row in rows]
    out = [[] for _ in range(R)]
    ends = {}  # (kind, stage, microbatch) -> end time
    live = [0] * R
    # How far down a list to look for a filler: a forward more than the
    # cap's worth of microbatches down would break the cap.
    window = [PERIOD * (cap + 2) for cap in caps]
    now, left = 0, sum(len(row) for row in rows)

    def done(kind, s, m):
        return ends.get((kind, s, m), now + 1) <= now

    def ready(kind, s, m):
        if kind == "F":
            return s == 0 or done("F", s - 1, m)
        if kind == "I":
            return done("F", s, m) and (s == S - 1 or done("I", s + 1, m))
        return done("I", s, m)

    def choose(r):
        todo = pending[r]
        if not forwards_left[r] and todo[0][0] == "W":
            first_i = next((j for j, a in enumerate(todo) if a[0] == "I"), None)
            if first_i is not None and ready(*todo[first_i]):
                return first_i
        if ready(*todo[0]):
            return 0
        high = running = live[r]  # the rank's live count along the list so far
        before = todo[0]
        for j, a in enumerate(islice(todo, 1, window[r]), start=1):
            running += (before[0] == "F") - (before[0] == "W")
            high = max(high, running)
            before = a
            if a[0] == "F" and high + 1 > caps[r]:
                return None  # nor can any later forward; rarely is anything else ready
            if ready(*a):
                return j
        return None

    while left:
        ran = False
        for r in range(R):
            if not pending[r]:
                continue
            j = choose(r)
            if j is None:
                continue
            ran = True
            a = pending[r][j]
            del pending[r][j]
            out[r].append(_ACTION[a[0]](a[1], a[2]))
            ends[a] = now + 1
            live[r] += (a[0] == "F") - (a[0] == "W")
            forwards_left[r] -= a[0] == "F"
            left -= 1
        # The earliest pending pass in block time has its inputs done (they come
        # earlier in the block) and heads its rank's list, so some rank runs at
        # every step; with unit passes, a step where none does repeats forever.
        if not ran:
            raise RuntimeError("the V-shape fill is stuck: a bug in schedules/_vshape.py")
        now += 1
    return out
