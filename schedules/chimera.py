"""Chimera (Li and Hoefler, SC'21): pipelines in both directions, each stage on several ranks."""

from jpipe import B, Costs, F, Schedule, register_schedule, simulate


@register_schedule("chimera")
def chimera(num_ranks, num_microbatches, num_chunks=1, pipelines=2):
    """Chimera: `pipelines` pipelines, half running down the ranks and half up, merged.

    Down pipeline j places stage s on rank (s + j * 2R/P) mod R, up pipeline j on
    rank (R - 1 - s - j * 2R/P) mod R, so every rank holds P stages, one of each
    pipeline, and every stage has P replicas (their gradients summed after the
    step). Microbatch m goes to pipeline m mod P; each pipeline runs its share
    as 1F1B, and each rank runs its actions in the order they start in those
    1F1B timelines with unit costs (F = B), the earlier microbatch first where
    two start together: the paper's merge.

    Placement: S = R stages, P replicas of each (P times 1F1B's parameters).
    Time: with P = 2, F = B and M even and at least R, a bubble of
      (R - 2) / (2M + R - 2), the paper's (docs/schedules.md has the figures
      at B = 2F too).
    Limits: P even and a divisor of R (so that the pipelines' shifts, 2R/P,
      are even and no two pipelines put a stage on one rank twice).
    """
    R, M, P = num_ranks, num_microbatches, pipelines
    if num_chunks != 1:
        raise ValueError(f"chimera places one stage of each pipeline per rank, got {num_chunks=}")
    if P < 2 or P % 2 or R % P:
        raise ValueError(
            f"chimera needs an even number of pipelines that divides the number of ranks; "
            f"got R={R}, pipelines={P}"
        )
    timed = [[] for _ in range(R)]
    for p in range(min(P, M)):
        mbs = range(p, M, P)
        shift = (p // 2) * (2 * R // P)
        place = [(s + shift) % R if p % 2 == 0 else (R - 1 - s - shift) % R for s in range(R)]
        alone = simulate(Schedule.of(_one_f_one_b(R, len(mbs), place)), Costs(F=1, B=1))
        for e in alone.timeline:
            a = e.action
            m = mbs[a.microbatch]
            timed[e.rank].append((e.start, m, (F if a.kind == "F" else B)(a.stage, m)))
    return [[a for *_, a in sorted(row, key=lambda t: t[:2])] for row in timed]


def _one_f_one_b(R, n, place):
    """1F1B of `n` microbatches over stages 0..R-1, stage s on rank place[s]."""
    rows = [[] for _ in range(R)]
    for s in range(R):
        warmup = min(R - 1 - s, n)
        row = rows[place[s]]
        row += [F(s, m) for m in range(warmup)]
        for m in range(n):
            if warmup + m < n:
                row.append(F(s, warmup + m))
            row.append(B(s, m))
    return rows
