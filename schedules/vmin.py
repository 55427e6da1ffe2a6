"""V-Min: a V-shaped schedule holding about a third of 1F1B's activation memory."""

from jpipe import register_schedule

from ._vshape import v_shape_rows


@register_schedule("vmin")
def vmin(num_ranks, num_microbatches, num_chunks=2):
    """V-Min (Qi et al., 2024): the V's least memory, for about two thirds of 1F1B's bubble.

    The building block of schedules/_vshape.py with no slack: every pass of
    a microbatch starts as soon as its input is done and its rank has a free
    slot in the six-unit period, so each residual lives as briefly as the V
    allows. The repeated block is then filled in the warm-up and cool-down
    without exceeding its steady-state peak.

    Placement: stage s on rank s for s < R, on rank 2R - 1 - s otherwise
      (S = 2R); each stage is half a rank's share of the model.
    Memory: every rank peaks at no more than 2 * floor((R + 4) / 3) live
      (stage, microbatch) activations, each half-size: floor((R + 4) / 3)
      full-stage microbatches, the paper's V-Min figure, against 1F1B's R
      (tests/test_vshape.py checks it for R up to 16).
    Time: with F = I = W, about two thirds of 1F1B's bubble, approaching it
      as M grows (0.67 to 0.79 of 1F1B's at R = 8 and 16, M = R to 8R; the
      same test tables it). The steady state leaves no slack, so transfer
      latency (Costs.comm) shows up as bubble at once.
    Limits: any R >= 1 and M >= 1. The placement fixes two chunks per rank:
      num_chunks must be 2 (1, the command line's default, is read as 2).
    """
    if num_chunks not in (1, 2):
        raise ValueError(
            f"vmin places exactly 2 stages per rank (a V), got num_chunks={num_chunks}"
        )
    return v_shape_rows(num_ranks, num_microbatches, slack=lambda k: 0)
