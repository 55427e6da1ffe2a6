"""1F1B with balanced recomputation: no rank holds more than k microbatches' residuals."""

from jpipe import FC, RECOMPUTE, register_schedule

from ._memory import keep_pattern, one_f_one_b_rows


@register_schedule("1f1b_recompute")
def one_f_one_b_recompute(num_ranks, num_microbatches, k=2):
    """1F1B where some forwards keep only their input and recompute before the backward.

    Rank r of 1F1B holds up to n = min(R - r, M) microbatches' residuals.
    Where n > k, some of its forwards are FC (keeping only the stage's input)
    and their RECOMPUTE runs one action before the B (ahead of the forward
    that precedes it in the steady state, or just before the B in the
    cool-down). A microbatch keeps its residuals (a plain F) when every n - 1
    consecutive microbatches then keep at most k - 1, so the rank never holds
    more than k microbatches' residuals: those kept plus the one being
    recomputed. Ranks with n <= k run plain 1F1B.

    Placement: stage r on rank r (S = R), as 1F1B.
    Memory: every rank peaks at min(k, R - r, M) microbatches' residuals, plus
      the kept inputs of its FC microbatches not yet recomputed.
    Time: each FC costs one more forward (its RECOMPUTE), on the ranks that
      hold more than k: about a fraction (n - k) / (n - 1) of their microbatches.
    Limits: any R >= 1 and M >= 1; k >= 1 (a backward reads one microbatch's
      residuals); one chunk per rank.
    """
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"1f1b_recompute needs k >= 1 microbatches' residuals per rank, got {k!r}")
    R, M = num_ranks, num_microbatches
    ranks = []
    for r, row in enumerate(one_f_one_b_rows(R, M)):
        n = min(R - r, M)
        if n <= k:
            ranks.append(row)
            continue
        keep = keep_pattern(M, [(n - 1, k - 1)])
        out = []
        for a in row:
            if a.kind == "F" and not keep[a.microbatch]:
                a = FC(r, a.microbatch)
            if a.kind == "B" and not keep[a.microbatch]:
                # One compute action ahead when that is a forward (the steady
                # state), else right before the B (the cool-down).
                at = len(out)
                if out[-1].kind in ("F", "FC") and out[-1].microbatch != a.microbatch:
                    at -= 1
                out.insert(at, RECOMPUTE(r, a.microbatch))
            out.append(a)
        ranks.append(out)
    return ranks
