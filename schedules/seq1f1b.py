"""Seq1F1B (Sun et al., NAACL'25): 1F1B over slices of each sequence along its tokens."""

from jpipe import B, F, Schedule, register_schedule


@register_schedule("seq1f1b")
def seq1f1b(num_ranks, num_microbatches, slices=4, lengths=None):
    """1F1B whose unit is one slice of a sequence: each of the M sequences is cut into
    `slices` pieces along its tokens, run as M x slices microbatches.

    A stage carries the keys and values of a sequence's earlier slices to its later
    ones, so a sequence's slices run forward in order and backward in reverse (the
    last slice's backward hands the carry's gradient to the one before it). Rank r
    runs min(U, R - 1 - r + slices - 1) warm-up forwards (U = M x slices): the slices
    - 1 more than 1F1B's let the last stage reach a sequence's last slice before its
    first backward; then one forward and one backward, the backwards taking each
    sequence's slices last to first; then the remaining backwards.

    Placement: stage r on rank r (S = R).
    Memory: rank 0 peaks at R + slices - 1 live slices, (R + slices - 1) / slices
      sequences' residuals, against 1F1B's R sequences.
    Time: with uniform costs a slice costs 1/slices of a sequence, so the bubble is
      (R - 1) / (M x slices + R - 1), 1F1B's with slices times the microbatches.
    Limits: any R >= 1, M >= 1 and slices >= 2; `lengths` the slices' relative
      lengths (``seq1f1b:slices=4,lengths=(5,4,4,3)``), even if not given.
    """
    R, M, k = num_ranks, num_microbatches, slices
    lengths = tuple(lengths) if lengths is not None else (1,) * k
    if len(lengths) != k:
        raise ValueError(f"seq1f1b: {len(lengths)} lengths {lengths} for {k} slices")
    units = M * k
    # backward order: each sequence's slices from the last to the first
    backward = [m * k + (k - 1 - j) for m in range(M) for j in range(k)]
    rows = []
    for r in range(R):
        warmup = min(units, R - 1 - r + k - 1)
        row = [F(r, u) for u in range(warmup)]
        for i, u in enumerate(backward):
            if warmup + i < units:
                row.append(F(r, warmup + i))
            row.append(B(r, u))
        rows.append(row)
    return Schedule.of(rows, slices=lengths)
