"""Interleaved 1F1B (Megatron-LM): looped placement, 1F1B over virtual stages."""

from jpipe import B, F, register_schedule


@register_schedule("interleaved_1f1b")
def interleaved_1f1b(num_ranks, num_microbatches, num_chunks=2):
    """Interleaved 1F1B: V stages per rank in a loop, 1F1B over rounds of microbatches.

    Microbatches are split into rounds of at least R (as even as possible,
    larger rounds first; one round of M when M < R). Within a round, rank r
    runs the forwards of the whole round through its first chunk, then its
    second, and so on; backwards go through the chunks in reverse. Rank r
    starts with (V - 1) G + 2(R - 1 - r) warm-up forwards (G the first round's
    size), as Megatron-LM does, then alternates one forward and one backward.

    Placement: stage s on rank s % R (S = R V).
    Memory: rank 0 peaks at min((V - 1) G + 2R - 1, V M) live (stage,
      microbatch) activations, each 1/V of a rank's share of the model: a
      little above 1F1B's R full activations when G = R.
    Time: with uniform costs the bubble shrinks by about V against 1F1B, to
      (R - 1) / (V M + R - 1) when R divides M.
    Limits: any R >= 1, M >= 1 and V >= 1 (rounds of at least R remove the
      usual "R divides M" rule); with V = 1 it is eager_1f1b.
    """
    R, M, V = num_ranks, num_microbatches, num_chunks
    if V < 1:
        raise ValueError(f"interleaved_1f1b needs at least one chunk per rank, got num_chunks={V}")
    # Rounds of at least R microbatches keep the first rank busy until the
    # first microbatch comes back round the loop.
    num_rounds = max(1, M // R)
    sizes = [M // num_rounds + (i < M % num_rounds) for i in range(num_rounds)]
    starts = [sum(sizes[:i]) for i in range(num_rounds)]
    rounds = [range(start, start + size) for start, size in zip(starts, sizes, strict=True)]
    ranks = []
    for r in range(R):
        forwards = [F(v * R + r, m) for rnd in rounds for v in range(V) for m in rnd]
        backwards = [B(v * R + r, m) for rnd in rounds for v in reversed(range(V)) for m in rnd]
        warmup = min((V - 1) * sizes[0] + 2 * (R - 1 - r), len(forwards))
        row = forwards[:warmup]
        for k, backward in enumerate(backwards):
            if warmup + k < len(forwards):
                row.append(forwards[warmup + k])
            row.append(backward)
        ranks.append(row)
    return ranks
