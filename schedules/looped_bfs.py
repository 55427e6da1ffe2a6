"""Looped BFS: looped placement, each chunk's microbatches breadth first."""

from jpipe import B, F, register_schedule


@register_schedule("looped_bfs")
def looped_bfs(num_ranks, num_microbatches, num_chunks=1):
    """Looped placement, breadth first: all microbatches of one chunk, then the next.

    Rank r holds V = num_chunks stages, r, r + R, ..., r + (V - 1)R. It runs
    the forward of every microbatch through its lowest stage, then through
    its next stage, and so on; then the backwards, highest stage first.

    Placement: stage s on rank s % R (S = R V).
    Memory: every rank peaks at V M live (stage, microbatch) activations,
      each 1/V of a rank's share of the model: GPipe's memory.
    Limits: any R >= 1, M >= 1 and V >= 1; with V = 1 it is GPipe.
    """
    R, M, V = num_ranks, num_microbatches, num_chunks
    if V < 1:
        raise ValueError(f"looped_bfs needs at least one chunk per rank, got num_chunks={V}")
    ranks = []
    for r in range(R):
        row = [F(v * R + r, m) for v in range(V) for m in range(M)]
        row += [B(v * R + r, m) for v in reversed(range(V)) for m in range(M)]
        ranks.append(row)
    return ranks
