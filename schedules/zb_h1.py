"""ZB-H1: zero-bubble schedule at 1F1B's memory (backward split into I and W)."""

from jpipe import F, I, W, register_schedule


@register_schedule("zb_h1")
def zb_h1(num_ranks, num_microbatches):
    """Zero Bubble H1: 1F1B with the backward split, weight gradients delayed.

    Forwards and input-gradient steps (I) follow 1F1B's order: rank r runs
    R - r forwards, then alternates I and F. The weight-gradient step W of
    microbatch m waits until after I of microbatch m + r, so on later ranks
    W fills the gaps where 1F1B would idle, and the input gradients that the
    upstream ranks wait for are never held up behind a W.

    Placement: stage r on rank r (S = R).
    Memory: every rank peaks at min(R, M) live activations, 1F1B's worst.
    Time: with uniform costs and M >= R the makespan is
      M(F + I + W) + (R - 1)(F + I - W), a third of 1F1B's bubble when
      F = I = W (Qi et al., "Zero Bubble Pipeline Parallelism", 2024).
    Limits: any R >= 1 and M >= 1; one chunk per rank.
    """
    R, M = num_ranks, num_microbatches
    ranks = []
    for r in range(R):
        warmup = min(R - r, M)
        row = [F(r, m) for m in range(warmup)]
        next_w = 0
        for m in range(M):
            row.append(I(r, m))
            if m - r >= 0:
                row.append(W(r, m - r))
                next_w += 1
            if warmup + m < M:
                row.append(F(r, warmup + m))
        row += [W(r, m) for m in range(next_w, M)]
        ranks.append(row)
    return ranks
