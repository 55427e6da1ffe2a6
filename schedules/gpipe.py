"""GPipe: every forward, then every backward."""

from jpipe import B, F, register_schedule


@register_schedule("gpipe")
def gpipe(num_ranks, num_microbatches):
    """All forwards, then all backwards, one stage per rank (GPipe).

    Placement: stage r on rank r (S = R).
    Memory: every microbatch is live at once, so each rank peaks at M
      activations.
    Time: with uniform costs the makespan is (M + R - 1)(F + B), a bubble
      fraction of (R - 1) / (M + R - 1).
    Limits: any R >= 1 and M >= 1; one chunk per rank.
    """
    R, M = num_ranks, num_microbatches
    return [[F(r, m) for m in range(M)] + [B(r, m) for m in range(M)] for r in range(R)]
