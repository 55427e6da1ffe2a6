"""1F1B (PipeDream-flush, DAPPLE): one forward, one backward in the steady state."""

from jpipe import B, F, register_schedule


@register_schedule("1f1b")
def one_f_one_b(num_ranks, num_microbatches):
    """One forward, one backward: warm-up, steady 1F1B, cool-down (PipeDream-flush).

    Rank r runs min(R - 1 - r, M) warm-up forwards, then alternates one
    forward and one backward until the forwards run out, then the remaining
    backwards.

    Placement: stage r on rank r (S = R).
    Memory: rank r peaks at min(R - r, M) live activations; rank 0 at min(R, M).
    Time: same makespan as GPipe, (M + R - 1)(F + B) with uniform costs.
    Limits: any R >= 1 and M >= 1; one chunk per rank.
    """
    R, M = num_ranks, num_microbatches
    ranks = []
    for r in range(R):
        warmup = min(R - 1 - r, M)
        row = [F(r, m) for m in range(warmup)]
        for m in range(M):
            if warmup + m < M:
                row.append(F(r, warmup + m))
            row.append(B(r, m))
        ranks.append(row)
    return ranks
