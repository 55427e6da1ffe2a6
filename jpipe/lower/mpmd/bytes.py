"""The per-rank lowering's bytes per device: each rank holds its own terms.

Each rank runs programs of its own on its own devices, so a device
allocates its rank's need: its stages' parameters, its own peak of live
values (residuals, carries, kept inputs, what it holds for a partner) and
the working memory of its own largest piece, with its gradients accumulated
in place (no copy returned beside them). A piece's working memory is held
only while it runs: where the figures give it per kind of piece
(`RankBytes.busy`), a rank holds at most the values when each piece starts
plus that piece's own, which can be less than its largest piece's on top of
its peak of values (a rank whose largest piece is not what runs at that
peak: ZB-H1's deferred Ws). One exception, while the ranks
share one mesh: the parameters are packed rows of every bucket, so each rank
holds the packed parameters and the optimizer state on them whole
(`RankBytes.packed_everywhere`; docs/design.md, "not yet the rank's own"):
the largest rank's bytes less its gradients, plus its own gradients. With a
mesh per rank (`jpipe.make_rank_meshes`) each holds its own.

`jpipe.lower.mpmd.programs.RankPrograms.account` counts the same terms from
the compiled pieces; the contract (`RankBytes` in, `HeldBytes` out) is
`jpipe.lower.bytes`'s; `jpipe.lower.interface.MPMD.byte_model()` gives this
model.
"""

from __future__ import annotations

from collections.abc import Sequence

from jpipe.lower.bytes import ByteModel, HeldBytes, RankBytes


class PerRankBytes(ByteModel):
    """Each device holds its own rank's terms (module docstring)."""

    def device_bytes(self, need: RankBytes) -> tuple[HeldBytes, ...]:
        params = need.params
        if need.packed_everywhere:
            grads = need.grads_or_zeros()
            shared = max(p - g for p, g in zip(params, grads))
            params = tuple(shared + g for g in grads)
        working = need.working
        if need.busy:  # working memory only while its piece runs: on top of the values then
            working = tuple(max(0.0, b - v) for b, v in zip(need.busy, need.values))
        return tuple(
            HeldBytes(overhead=o, params=p, grad_output=0.0, values=v, working=w)
            for o, p, v, w in zip(need.overhead_or_zeros(), params, need.values, working)
        )

    def stage_room(
        self, device_room: Sequence[Sequence[float]], stage_ranks: Sequence[Sequence[int]]
    ) -> list[float]:
        """Each stage's room on its own ranks: the least of their devices' (every rank
        that holds a copy of a replicated stage holds all of the stage's bytes)."""
        return [min(min(device_room[r]) for r in ranks) for ranks in stage_ranks]
