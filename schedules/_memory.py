"""Helpers shared by the built-ins with memory actions (1f1b_bpipe, 1f1b_recompute).

Both start from 1F1B's lists and choose, microbatch by microbatch, which ones
keep their residuals on the rank the whole time. In 1F1B rank r runs
``w = R - 1 - r`` warm-up forwards, then ``F(m + w)`` and ``B(m)`` by turns,
so right after ``F(m + w)`` the rank holds microbatches ``m .. m + w``: a
window of ``n = min(R - r, M)``. A microbatch that does not keep its
residuals (recomputed, or evicted to a partner) holds them again from one
action before its ``B``: the action before ``B(m)`` is ``F(m + w)``, so at
that moment the rank holds ``m`` and those of ``m + 1 .. m + w`` that kept
theirs. `keep_pattern` chooses the kept microbatches so that every run of
consecutive microbatches of a given length keeps at most a given number.
"""

from jpipe import get_schedule


def one_f_one_b_rows(num_ranks, num_microbatches):
    """1F1B's lists (schedules/1f1b.py), as lists of actions."""
    return [list(row) for row in get_schedule("1f1b", num_ranks, num_microbatches).ranks]


def keep_pattern(num_microbatches, limits):
    """`keep[m]` for each microbatch, greedily from microbatch 0.

    `limits` holds `(length, most)` pairs: any `length` consecutive
    microbatches keep at most `most`. A microbatch keeps its residuals when
    that breaks no limit.
    """
    keep = []
    for m in range(num_microbatches):
        ok = all(
            sum(keep[max(0, m - length + 1) : m]) + 1 <= most
            for length, most in limits
            if length > 0
        )
        keep.append(ok)
    return keep
