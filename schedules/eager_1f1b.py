"""Eager 1F1B: 1F1B with a longer warm-up, so transfers overlap compute."""

from jpipe import B, F, register_schedule


@register_schedule("eager_1f1b")
def eager_1f1b(num_ranks, num_microbatches):
    """1F1B with twice the warm-up, so transfers hide behind compute.

    Rank r runs min(2(R - 1 - r), M) warm-up forwards (1F1B runs R - 1 - r),
    then alternates one forward and one backward, then finishes the
    backwards. The extra forwards in flight let each rank keep computing
    while a gradient is still on its way, so with a transfer latency it
    finishes sooner than 1F1B; with none it takes the same time.

    Placement: stage r on rank r (S = R).
    Memory: rank r peaks at min(2(R - r) - 1, M) live activations; rank 0 at
      min(2R - 1, M), about twice 1F1B's.
    Limits: any R >= 1 and M >= 1; one chunk per rank.
    """
    R, M = num_ranks, num_microbatches
    ranks = []
    for r in range(R):
        warmup = min(2 * (R - 1 - r), M)
        row = [F(r, m) for m in range(warmup)]
        for m in range(M):
            if warmup + m < M:
                row.append(F(r, warmup + m))
            row.append(B(r, m))
        ranks.append(row)
    return ranks
