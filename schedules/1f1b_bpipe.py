"""BPipe: 1F1B whose early ranks evict residuals to a late partner and load them back."""

from jpipe import EVICT, LOAD, register_schedule

from ._memory import keep_pattern, one_f_one_b_rows


@register_schedule("1f1b_bpipe")
def one_f_one_b_bpipe(num_ranks, num_microbatches):
    """BPipe (Kim et al., 2023): rank r and rank R - 1 - r share their activation memory.

    In 1F1B rank r holds up to n = min(R - r, M) microbatches and its partner
    R - 1 - r up to min(r + 1, M). An early rank (r < R - 1 - r) evicts some
    microbatches' residuals to its partner right after their forward
    (EVICT(r, m, R - 1 - r)) and loads them back one compute action before
    their backward (LOAD), so that the transfer can hide behind that action.
    Which ones is chosen per pair so that the larger of the two ranks' peaks
    is smallest: a microbatch keeps its residuals where every n - 2
    consecutive microbatches then keep at most T - 2 and every n - 1 at most
    T - 1 (the loaded one and the newest forward are both held for a moment),
    T tried from n down. The middle rank of an odd R has no partner.

    Placement: stage r on rank r (S = R), as 1F1B.
    Memory: each pair peaks near half of the pair's 1F1B total, (R + 1) / 2
      microbatches, the partner's holding included (about 0.6 of 1F1B's
      busiest rank at R = 8).
    Time: 1F1B's where transfers are free; each load that takes longer than
      the action before the backward delays it (Costs.evict, Costs.load).
    Limits: any R >= 1 and M >= 1; one chunk per rank.
    """
    R, M = num_ranks, num_microbatches
    ranks = one_f_one_b_rows(R, M)
    for r in range(R):
        p = R - 1 - r
        if p <= r:
            continue
        n, n_p = min(R - r, M), min(R - p, M)
        best = (max(n, n_p), ranks[r])  # evicting nothing
        for T in range(n - 1, 1, -1):
            keep = keep_pattern(M, [(n - 2, T - 2), (n - 1, T - 1)])
            row = _evicting(ranks[r], keep, r, p)
            own, held = _counts(row)
            score = max(own, n_p + held)
            if best is None or score < best[0]:
                best = (score, row)
        ranks[r] = best[1]
    return ranks


def _evicting(row, keep, r, p):
    """`row` with EVICT after each forward not kept and its LOAD one action before the B."""
    out = []
    for a in row:
        if a.kind == "B" and not keep[a.microbatch]:
            at = len(out) - 1  # the compute action before the B ...
            while out[at].kind == "EVICT":  # ... not an eviction issued after it
                at -= 1
            if out[at].microbatch == a.microbatch and out[at].kind == "F":
                at += 2  # its own forward and eviction: load right after them
            out.insert(at, LOAD(r, a.microbatch, p))
        out.append(a)
        if a.kind == "F" and not keep[a.microbatch]:
            out.append(EVICT(r, a.microbatch, p))
    return out


def _counts(row):
    """The most residuals `row` holds on its rank and the most it has evicted, in list order."""
    own = held = most_own = most_held = 0
    for a in row:
        own += {"F": 1, "B": -1, "EVICT": -1, "LOAD": 1}.get(a.kind, 0)
        held += {"EVICT": 1, "LOAD": -1}.get(a.kind, 0)
        most_own, most_held = max(most_own, own), max(most_held, held)
    return most_own, most_held
