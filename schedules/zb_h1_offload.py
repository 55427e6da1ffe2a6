"""ZB-H1 with its longest-lived residuals offloaded to host memory between uses."""

from jpipe import (
    OFFLOAD_END,
    OFFLOAD_START,
    RELOAD_END,
    RELOAD_START,
    get_schedule,
    register_schedule,
)


@register_schedule("zb_h1_offload")
def zb_h1_offload(num_ranks, num_microbatches, min_gap=3):
    """ZB-H1 whose residuals go to the host while no action on their rank reads them.

    A (stage, microbatch)'s residuals are read by its F (made), its I and its
    W. In ZB-H1 they wait R - r actions or so on rank r between F and I and
    about 2r between I and W; each is offloaded over the longer of its two
    waits when that wait spans at least `min_gap` compute actions (PipeOffload
    likewise drops an offload whose gap is short next to the transfer): an
    OFFLOAD_START right after the action that makes or last reads them, its
    OFFLOAD_END one compute action later (the copy hides behind that action),
    a RELOAD_START one compute action before the next reader and its
    RELOAD_END right before it. In between the device holds none of them.

    Placement: stage r on rank r (S = R), as ZB-H1.
    Memory: below ZB-H1's R microbatches on every rank whose waits are long
      enough; each offloaded microbatch is on the device only around its
      readers (plus the carry an I hands its W, which stays).
    Time: ZB-H1's where copies are free; a copy longer than the action it
      hides behind delays the rank (Costs.offload, Costs.reload).
    Limits: any R >= 1 and M >= 1; min_gap >= 3 (an offload must free the
      residuals for at least one action); one chunk per rank.
    """
    if not isinstance(min_gap, int) or isinstance(min_gap, bool) or min_gap < 3:
        raise ValueError(f"zb_h1_offload needs min_gap >= 3 compute actions, got {min_gap!r}")
    rows = get_schedule("zb_h1", num_ranks, num_microbatches).ranks
    ranks = []
    for row in rows:
        at = {(a.kind, a.microbatch): i for i, a in enumerate(row)}
        before = [[] for _ in row]  # inserted before row[i]: reloads begun, then waited for
        after = [[] for _ in row]  # inserted after row[i]: offloads begun, then waited for
        for a in row:
            if a.kind != "F":
                continue
            s, m = a.stage, a.microbatch
            f, i, w = at[("F", m)], at[("I", m)], at[("W", m)]
            made, read = max(((f, i), (i, w)), key=lambda gap: gap[1] - gap[0])
            if read - made - 1 < min_gap:
                continue
            after[made].insert(0, OFFLOAD_START(s, m))
            after[made + 1].append(OFFLOAD_END(s, m))
            before[read - 1].insert(0, RELOAD_START(s, m))
            before[read].append(RELOAD_END(s, m))
        ranks.append([x for i, a in enumerate(row) for x in (*before[i], a, *after[i])])
    return ranks
