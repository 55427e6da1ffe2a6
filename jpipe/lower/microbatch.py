"""How a batch is cut into microbatches, the same way everywhere.

Microbatch m of a batch of N rows is rows ``m, m + M, m + 2M, ...``: a
reshape, so cutting costs nothing and a batch sharded over ``data`` on its
rows stays sharded. The SPMD program cuts its batch this way
(`split_microbatches`), the per-rank lowering takes each microbatch's rows
the same way, and the unpipelined reference loops over `microbatches`.
"""

from __future__ import annotations

import jax


def split_microbatches(batch, num_microbatches: int):
    """``[N, ...] -> [N / M, M, ...]``: microbatch m is ``[:, m]``, rows m, m + M, ...

    A reshape, so it costs nothing (a transpose to ``[M, N / M]`` would copy
    the whole batch every step), and a batch sharded over ``data`` on its rows
    stays sharded on the first axis.
    """

    def cut(a):
        n = a.shape[0]
        return a.reshape((n // num_microbatches, num_microbatches) + a.shape[1:])

    return jax.tree.map(cut, batch)


def microbatches(batch, num_microbatches: int):
    """``[N, ...] -> [M, N / M, ...]``: the microbatches stacked first, to loop over.

    Microbatch m is rows ``m, m + M, m + 2M, ...`` as in `split_microbatches`
    (this is its transpose, a copy: for references and baselines, not the pipeline).
    """
    return jax.tree.map(lambda a: a.swapaxes(0, 1), split_microbatches(batch, num_microbatches))
