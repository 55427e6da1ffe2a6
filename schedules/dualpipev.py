"""DualPipeV: a V-shaped schedule that overlaps one microbatch's forward with another's backward."""

from jpipe import B, F, I, Overlap, W, register_schedule


@register_schedule("dualpipev")
def dualpipev(num_ranks, num_microbatches, num_chunks=2):
    """DualPipeV: V placement, forward of one stage overlapped with backward of the other.

    Rank r holds stage r ("down") and stage 2R-1-r ("up"), as in zbv. With
    k = R - 1 - r, rank r runs:
      1. 2k down-forwards;
      2. r + 1 pairs of down- and up-forward;
      3. k rounds of up-backward (as I then W), up-forward;
      4. M - 2R + r + 1 rounds of two overlapped cells,
         Overlap(F(down), B(up)) and Overlap(F(up), B(down)); the last rank
         runs its first down-forward and up-backward apart;
      5. k rounds of up-backward, Overlap(F(up), B(down));
      6. r + 1 rounds of up-backward, down-backward; from the middle round on
         a backward is an I whose W is queued;
      7. k rounds of a queued W, down-backward (as I);
      8. the remaining queued Ws.
    An Overlap cell runs its forward and backward together, so one's
    communication hides behind the other's compute; the simulator charges
    both costs in turn. For R = 4, M = 10 this is the schedule PyTorch writes.

    Placement: stage s on rank s for s < R, on rank 2R - 1 - s otherwise
      (S = 2R); each stage is half a rank's share of the model.
    Memory: every rank peaks at 2R + 1 live (stage, microbatch) activations,
      each half-size.
    Limits: M >= 2R, so that every rank reaches the overlapped steady state
      (DeepSeek's requirement); num_chunks must be 2 (1, the command line's
      default, is read as 2).
    """
    R, M = num_ranks, num_microbatches
    if num_chunks not in (1, 2):
        raise ValueError(
            f"dualpipev places exactly 2 stages per rank (a V), got num_chunks={num_chunks}"
        )
    if M < 2 * R:
        raise ValueError(
            f"dualpipev needs at least twice as many microbatches as ranks "
            f"(M >= 2R = {2 * R}), got {M}"
        )
    return [_rank(R, M, r) for r in range(R)]


def _rank(R, M, r):
    """Rank r's list, the eight steps of the docstring in order."""
    down, up = r, 2 * R - 1 - r
    forwards = {down: 0, up: 0}
    backwards = {down: 0, up: 0}
    row, queued_w = [], []
    split = False

    def fwd(s):
        forwards[s] += 1
        return F(s, forwards[s] - 1)

    def bwd(s, split_now=False):
        m = backwards[s]
        backwards[s] += 1
        if split or split_now:
            queued_w.append(W(s, m))
            return I(s, m)
        return B(s, m)

    k = R - 1 - r
    row += [fwd(down) for _ in range(2 * k)]
    for _ in range(r + 1):
        row += [fwd(down), fwd(up)]
    for _ in range(k):
        row += [bwd(up, split_now=True), queued_w.pop(0), fwd(up)]
    for i in range(M - 2 * R + r + 1):
        if i == 0 and r == R - 1:
            row += [fwd(down), bwd(up)]
        else:
            row.append(Overlap(fwd(down), bwd(up)))
        row.append(Overlap(fwd(up), bwd(down)))
    for _ in range(k):
        row += [bwd(up), Overlap(fwd(up), bwd(down))]
    for i in range(r + 1):
        # Odd ranks split from the up-backward of the middle round, even ranks
        # from its down-backward.
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        row.append(bwd(up))
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        row.append(bwd(down))
    for _ in range(k):
        row += [queued_w.pop(0), bwd(down)]
    return row + queued_w
