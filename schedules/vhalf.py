"""V-Half: a V-shaped schedule holding about half of 1F1B's activation memory."""

from jpipe import register_schedule

from ._vshape import v_shape_rows


@register_schedule("vhalf")
def vhalf(num_ranks, num_microbatches, num_chunks=2):
    """V-Half (Qi et al., 2024): half of 1F1B's activation memory for about half its bubble.

    The building block of schedules/_vshape.py where every other pass on a
    microbatch's path (F(1), F(3), ..., then I(2R-2), ..., I(0)) waits one
    unit more than its input needs: residuals live about 1.5 times as long
    as in vmin, and the memory this buys lets the warm-up run more forwards
    ahead. The repeated block is then filled in the warm-up and cool-down
    without exceeding its steady-state peak.

    Placement: stage s on rank s for s < R, on rank 2R - 1 - s otherwise
      (S = 2R); each stage is half a rank's share of the model.
    Memory: every rank peaks at no more than 2 * floor((R + 2) / 2) live
      (stage, microbatch) activations, each half-size: floor((R + 2) / 2)
      full-stage microbatches, the paper's V-Half figure, against 1F1B's R
      (tests/test_vshape.py checks it for R up to 16).
    Time: with F = I = W, about half of 1F1B's bubble (0.45 to 0.62 of
      1F1B's at R = 8 and 16, M = R to 4R; the same test tables it).
    Limits: any R >= 1 and M >= 1. The placement fixes two chunks per rank:
      num_chunks must be 2 (1, the command line's default, is read as 2).
    """
    if num_chunks not in (1, 2):
        raise ValueError(
            f"vhalf places exactly 2 stages per rank (a V), got num_chunks={num_chunks}"
        )
    return v_shape_rows(num_ranks, num_microbatches, slack=lambda k: k % 2)
