"""ZB-V: zero-bubble schedule on a V-shaped placement, two stages per rank."""

from jpipe import F, I, W, register_schedule


@register_schedule("zbv")
def zbv(num_ranks, num_microbatches, num_chunks=2, max_deferred_w=None):
    """Zero Bubble V: two stages per rank placed in a V, backward split into I and W.

    A microbatch goes down the ranks through stages 0..R-1 and back up through
    stages R..2R-1, so rank r holds stage r ("down") and stage 2R-1-r ("up"),
    and the first and last stages share rank 0. Rank r runs 2(R - 1 - r)
    down-forwards, then r + 1 down/up forward pairs, then R - 1 - r rounds of
    (I, W, F) on the up stage; in the steady state it repeats
    F(down) I(up) W F(up) I(down) W, and in the cool-down it runs the input
    gradients first and leaves the weight gradients for last, where they fill
    the gaps. This is DualPipeV's step plan without the overlapped cells.

    Placement: stage s on rank s for s < R, on rank 2R - 1 - s otherwise
      (S = 2R); each stage is half a rank's share of the model.
    Memory: each rank peaks at no more than 2R + 1 live (stage, microbatch)
      activations, each half-size: about the R full activations of 1F1B's
      first rank.
    Time: with F = I = W and M >= 2R - 1 it meets the start-up bound
      2M(F + I + W) + (R - 1)F exactly: zero bubble after the start-up. With
      fewer microbatches the V cannot be kept full and some bubble remains
      (for M close to R on many ranks it can exceed ZB-H1's; prefer zb_h1 there).
    Carries: an I keeps what its W needs (the carry) until the W runs, so
      each deferred W is memory too; the last rank defers up to 2R of them
      (at GPT-2-small widths, 8 ranks, M = 16: 1.6 GiB). ``max_deferred_w``
      bounds how many W a rank leaves for later in the cool-down (the oldest
      runs at once beyond that), trading bubble for those bytes: at R = 8,
      M = 16 with F = I = W, 12 costs 3% of the step, 10 5%, and 8 or fewer
      7%, as much as 0 (every W right after its I: one carry at a time).
      ``zbv:max_deferred_w=0`` on the command line.
    Limits: any R >= 1 and M >= 1. The placement fixes two chunks per rank:
      num_chunks must be 2 (1, the command line's default, is read as 2);
      max_deferred_w is None (no bound) or an int >= 0.
    """
    R, M = num_ranks, num_microbatches
    if num_chunks not in (1, 2):
        raise ValueError(f"zbv places exactly 2 stages per rank (a V), got num_chunks={num_chunks}")
    cap = max_deferred_w
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 0):
        raise ValueError(
            f"zbv's max_deferred_w must be None or an int >= 0 (weight gradients a rank may "
            f"leave for later), got {max_deferred_w!r}"
        )
    cap = 2 * R * M if cap is None else cap
    return [_rank(R, M, r, cap) for r in range(R)]


def _rank(R, M, r, cap):
    """Rank r's list; steps with nothing left to run are skipped (small M)."""
    stage = (r, 2 * R - 1 - r)  # (down, up)
    forwards, backwards = [0, 0], [0, 0]
    row, pending_w = [], []
    defer_w = False

    def fwd(c):
        # The up stage's forward of m needs this rank's down forward of m.
        limit = M if c == 0 else forwards[0]
        if forwards[c] < limit:
            row.append(F(stage[c], forwards[c]))
            forwards[c] += 1

    def bwd(c):
        # The down stage's backward of m needs this rank's up backward of m.
        limit = forwards[1] if c == 1 else min(forwards[0], backwards[1])
        if backwards[c] < limit:
            row.append(I(stage[c], backwards[c]))
            pending_w.append(W(stage[c], backwards[c]))
            backwards[c] += 1
            if not defer_w or len(pending_w) > cap:
                row.append(pending_w.pop(0))

    k = R - 1 - r
    for _ in range(2 * k):
        fwd(0)
    for _ in range(r + 1):
        fwd(0), fwd(1)
    for _ in range(k):
        bwd(1), fwd(1)
    for _ in range(M - 2 * R + r + 1):
        fwd(0), bwd(1), fwd(1), bwd(0)
    for _ in range(k):
        bwd(1), fwd(1), bwd(0)
    defer_w = True
    while backwards[0] < M:
        fwd(1), bwd(1), bwd(0)
    return row + pending_w
