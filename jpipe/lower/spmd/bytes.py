"""The SPMD lowering's bytes per device: every device holds the busiest rank's terms.

One program runs on every device, and one program has one buffer of each
kind, sized for the rank that needs it most: every device allocates the
largest rank's parameters, the gradients the step returns beside its
accumulator, the residual and carry buffers as the program sizes them from
its tick plan (`tick_buffers`; or, where a caller does not size them, the
largest rank's peak of live values) and the largest piece's working memory.
The terms may come from different ranks (docs/design.md). Only a device's
fixed overhead is its own.

The contract (`RankBytes` in, `HeldBytes` out) is `jpipe.lower.bytes`'s;
`jpipe.lower.interface.SPMD.byte_model()` gives this model.
"""

from __future__ import annotations

from collections.abc import Sequence

from jpipe.lower.bytes import ByteModel, HeldBytes, RankBytes
from jpipe.lower.spmd.ticks import pack_lifetimes, plan_lifetimes
from jpipe.schedule.actions import Schedule


class SpmdBytes(ByteModel):
    """Every device holds the busiest rank's terms (module docstring)."""

    def device_bytes(self, need: RankBytes) -> tuple[HeldBytes, ...]:
        buffers = need.tick_buffers
        values = max(need.values) if buffers is None else sum(buffers)
        return tuple(
            HeldBytes(
                overhead=overhead,
                params=max(need.params),
                grad_output=max(need.grads_or_zeros()),
                values=values,
                working=max(need.working),
                buffers=buffers,
            )
            for overhead in need.overhead_or_zeros()
        )

    def buffers(
        self, schedule: Schedule, activation: Sequence[float], carry: Sequence[float]
    ) -> tuple[float, float]:
        """The program's residual and carry buffers as it sizes them (`tick_buffers`)."""
        return tick_buffers(schedule, activation, carry)

    def stage_room(
        self, device_room: Sequence[Sequence[float]], stage_ranks: Sequence[Sequence[int]]
    ) -> list[float]:
        """The smallest device's room for every stage: each device holds the largest stage's."""
        smallest = min(room for rank in device_room for room in rank)
        return [smallest] * len(stage_ranks)


def tick_buffers(
    schedule: Schedule, activation: Sequence[float], carry: Sequence[float]
) -> tuple[float, float]:
    """The SPMD program's residual and carry buffers, in bytes, as it sizes them.

    `activation` and `carry` are each stage's residual and I-to-W carry bytes
    per microbatch. `jpipe.make_tick_plan` lays the schedule out in lock-step
    ticks, and on each rank every residual (and carry) is placed for its
    lifetime in ticks by first fit (`pack_lifetimes`); every device
    allocates the largest rank's extent of each buffer (docs/design.md). A
    value can live longer in ticks than in the simulated time, and a full
    backward runs as its I then its W, so this can be above the simulator's
    peak. Memory actions split a residual's lifetime at each copy: an
    evicted one lives in its partner's buffer until it is loaded back, an
    offloaded one in the host buffer, which is not device memory (on XLA:CPU,
    which has no host memory space, the compiled temp counts it too:
    docs/design.md). Each value is one size here, where the program rounds
    each leaf up to whole rows of its buffer: on GPT-2 small both buffers
    came out exactly the program's (docs/search.md).
    """
    lifetimes = plan_lifetimes(schedule)  # `make_tick_plan(schedule).lifetimes`, without the rest
    extents = []
    for arena, sizes in (("res", activation), ("carry", carry)):
        most = 0.0
        for ivs in lifetimes.get(arena, ()):
            extent, _ = pack_lifetimes(ivs, lambda key, sizes=sizes: sizes[key[0]])
            most = max(most, extent)
        extents.append(float(most))
    return extents[0], extents[1]
