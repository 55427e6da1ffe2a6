"""DualPipe (DeepSeek-V3): microbatches from both ends, two copies of the model."""

from jpipe import Action, Overlap, register_schedule

from .dualpipev import dualpipev


@register_schedule("dualpipe")
def dualpipe(num_ranks, num_microbatches, num_chunks=1):
    """DualPipe: half the microbatches enter at rank 0, half at rank R-1; two copies.

    Rank r holds stage r for the microbatches that go down (0 .. M/2-1, entering at
    rank 0) and stage R-1-r for those that go up (M/2 .. M-1, entering at rank R-1),
    so stages s and R-1-s are each on ranks s and R-1-s (two replicas, their
    gradients summed). Rank r < R/2 runs `dualpipev`'s rank r on R/2 ranks and M/2
    microbatches, its first stage's work on the down microbatches and its second
    stage's on the up ones; rank R-1-r runs the same list mirrored (directions
    swapped). That fold is how DualPipeV is derived from DualPipe; unfolded, each
    overlapped cell pairs a forward of one direction with a backward of the other.

    Placement: S = R stages, each on two ranks (twice 1F1B's parameters).
    Time: DeepSeek-V3 gives a bubble of (R/2 - 1)(F&B + B - 3W), F&B being an
      overlapped cell; the simulator, which charges a cell F + B, gives half
      of that at F = I = W = 1 (docs/schedules.md).
    Limits: R even, M even and M >= 2R (each direction at least R microbatches).
    """
    R, M = num_ranks, num_microbatches
    if num_chunks != 1:
        raise ValueError(f"dualpipe places one stage of each direction per rank, got {num_chunks=}")
    if R % 2 or M % 2 or M < 2 * R:
        raise ValueError(
            f"dualpipe needs an even number of ranks and an even number of microbatches, "
            f"at least 2R = {2 * R}; got R={R}, M={M}"
        )
    half = dualpipev(R // 2, M // 2)
    rows = [None] * R
    for r, row in enumerate(half):
        # dualpipev's rank r holds stages r (first) and R-1-r (second) of the fold
        for rank, first_mb, second_mb in ((r, 0, M // 2), (R - 1 - r, M // 2, 0)):
            mb = {r: first_mb, R - 1 - r: second_mb}
            rows[rank] = [_relabel(step, mb) for step in row]
    return rows


def _relabel(step, offset):
    """`step` with each action's microbatch moved by its stage's `offset` (a direction)."""
    if isinstance(step, Overlap):
        return Overlap(_relabel(step.forward, offset), _relabel(step.backward, offset))
    return Action(step.kind, step.stage, step.microbatch + offset[step.stage])
