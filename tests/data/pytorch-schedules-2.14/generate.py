"""Writes the CSVs in this folder with PyTorch 2.14.1's own schedule classes.

Run by hand, in a virtual environment of its own (PyTorch is no dependency of
jpipe, and the test suite reads only the CSVs this writes)::

    python3.11 -m venv /tmp/torchvenv
    /tmp/torchvenv/bin/pip install torch==2.14.1
    /tmp/torchvenv/bin/python tests/data/pytorch-schedules-2.14/generate.py

No process group is needed: each schedule class is built with stand-in stage
objects that carry only what the classes read while building their orders
(``num_stages``, ``group_size``, ``group_rank``, ``stage_index``, ``submod``),
as PyTorch's own ``_schedule_visualizer.get_schedule_ops`` does with its mock
stage (whose compute orders this script checks are the same). The orders are
PyTorch's (``pipeline_order``, and ``pipeline_order_with_comms`` made by
``_prepare_schedule_with_comms``: ``_add_unshard_reshard``,
``_add_reduce_grad``, ``_add_send_recv``), written by PyTorch's ``_dump_csv``:

- ``{name}_{R}rank_{M}mb_compute.csv``: ``_dump_csv(f, format="compute_only")``,
  the compute order with PyTorch's blank (``None``) cells.
- ``{name}_{R}rank_{M}mb_comms.csv``: ``_dump_csv(f)``, the default
  ``compute_comms`` form with ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B``,
  ``UNSHARD``/``RESHARD`` and ``REDUCE_GRAD`` cells.
- ``{name}_{R}rank_{M}mb_comms_defer.csv`` (a few): the same with the class
  built with ``defer_pp_recv=True``, each ``RECV`` moved as late as it can go.
- The single-stage classes (``ScheduleGPipe``, ``Schedule1F1B``) have no
  ``_dump_csv`` and no communication form; their ``pipeline_order`` (which
  already holds ``REDUCE_GRAD`` cells, the blanks dropped) is written with
  ``PipelineScheduleMulti._dump_csv``, the same ``csv.writer`` rows, as
  ``{name}_{R}rank_{M}mb_order.csv``.

``manifest.json`` records, per file, the class, ranks, stages, microbatches,
whether PyTorch's own ``_validate_schedule`` accepts the compute order (and its
message when not). (PyTorch's ``_simulate`` refuses the comms form it writes:
it has no rule for ``UNSHARD``.)

Invalid orders: ``Schedule1F1B`` builds its ``pipeline_order`` with the last
rank's forwards numbered ``1..M`` (a stray microbatch ``M``, ``0`` missing),
for every ``M``; PyTorch runs 1F1B through ``_step_microbatches`` and never
executes this order, and its ``_validate_schedule`` refuses it. With fewer
microbatches than ranks the constructor raises ``ValueError`` after the order
is built (``PipelineScheduleSingle.__init__`` builds it first); those orders,
``1f1b_{R}rank_{M}mb_order.csv`` with ``M < R``, are taken from the
half-built object.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch.distributed.pipelining import schedules as S
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

HERE = Path(__file__).parent


class _Stage:
    """What the schedule classes read of a stage while building their orders."""

    def __init__(self, stage_index: int, num_stages: int, group_size: int, group_rank: int):
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = group_rank
        self.submod = None  # not an nn.Module: the torch.compile check skips it
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.stage_index_to_group_rank: dict[int, int] = {}


def _stages(ranks: int, per_rank: int, style: str) -> list[_Stage]:
    """Rank 0's stages (the classes build every rank's order from any rank)."""
    n = ranks * per_rank
    mapping = S.generate_stage_to_rank_mapping(ranks, n, style=style)
    return [_Stage(s, n, ranks, 0) for s in range(n) if mapping[s] == 0]


def _loss(x, y):  # a loss function makes the schedules include backwards
    return x


def _dump_order(order: dict, path: Path) -> None:
    """``PipelineScheduleMulti._dump_csv``, as PyTorch writes ``pipeline_order``."""
    holder = type("Holder", (), {})()
    holder.pipeline_order = order
    S.PipelineScheduleMulti._dump_csv(holder, os.fspath(path))


def _validate(order: dict, ranks: int, stages: int, microbatches: int) -> str | None:
    try:
        S._validate_schedule(order, ranks, stages, microbatches)
    except (AssertionError, ValueError) as e:
        return str(e).split("\n")[0]
    return None


MULTI = {
    # name: (class, stages per rank, placement)
    "interleaved_1f1b": (S.ScheduleInterleaved1F1B, 2, "loop"),
    "looped_bfs": (S.ScheduleLoopedBFS, 2, "loop"),
    "interleaved_zb": (S.ScheduleInterleavedZeroBubble, 2, "loop"),
    "zbv": (S.ScheduleZBVZeroBubble, 2, "v"),
    "dualpipev": (S.ScheduleDualPipeV, 2, "v"),
}
SINGLE = {"gpipe": S.ScheduleGPipe, "1f1b": S.Schedule1F1B}
# ranks: microbatch counts (R, 2R and a count that is no multiple of R; 4R at 2 ranks)
GRID = {2: (2, 3, 4, 8), 4: (4, 6, 8), 8: (8, 12, 16)}
# DualPipeV refuses fewer microbatches than stages (2R): 2R, 2R + 1 or 2R + 2, 4R
GRID_DUALPIPEV = {2: (4, 5, 8), 4: (8, 10, 16), 8: (16,)}
DEFER = ((2, 4), (4, 8), (4, 10))  # also written with defer_pp_recv=True
INVALID_1F1B = ((2, 1), (4, 2), (8, 4))  # fewer microbatches than ranks: the constructor raises


def main() -> None:
    if not torch.__version__.startswith("2.14."):
        sys.exit(f"expected PyTorch 2.14, got {torch.__version__}")
    for old in HERE.glob("*.csv"):
        old.unlink()
    manifest: dict[str, dict] = {}

    def note(path: Path, **fields) -> None:
        manifest[path.name] = fields

    for name, (cls, per_rank, style) in MULTI.items():
        for ranks, counts in (GRID_DUALPIPEV if name == "dualpipev" else GRID).items():
            for M in counts:
                stages = _stages(ranks, per_rank, style)
                n = stages[0].num_stages
                try:
                    sched = cls(stages, M, loss_fn=_loss)
                except (ValueError, AssertionError) as e:
                    print(f"skipped {name} {ranks} ranks {M} mb: {type(e).__name__}: {e}")
                    continue
                base = f"{name}_{ranks}rank_{M}mb"
                common = dict(
                    cls=cls.__name__,
                    ranks=ranks,
                    stages=n,
                    microbatches=M,
                    stage_to_rank=[sched.stage_index_to_group_rank[s] for s in range(n)],
                )
                compute, comms = HERE / f"{base}_compute.csv", HERE / f"{base}_comms.csv"
                sched._dump_csv(os.fspath(compute), format="compute_only")
                sched._dump_csv(os.fspath(comms))  # format="compute_comms", the default
                invalid = _validate(sched.pipeline_order, ranks, n, M)
                note(compute, form="compute_only", pytorch_invalid=invalid, **common)
                note(comms, form="compute_comms", **common)
                # PyTorch's own no-process-group path builds the same orders
                ops = get_schedule_ops(cls, ranks, M)
                assert [list(ops[r]) for r in range(ranks)] == [
                    list(sched.pipeline_order[r]) for r in range(ranks)
                ], base
                if (ranks, M) in DEFER:  # RECVs as late as they can be (defer_pp_recv=True)
                    deferred = cls(stages, M, loss_fn=_loss, defer_pp_recv=True)
                    path = HERE / f"{base}_comms_defer.csv"
                    deferred._dump_csv(os.fspath(path))
                    note(path, form="compute_comms", defer_pp_recv=True, **common)

    for name, cls in SINGLE.items():
        for ranks, counts in GRID.items():
            for M in counts:
                sched = cls(_Stage(0, ranks, ranks, 0), M, loss_fn=_loss)
                path = HERE / f"{name}_{ranks}rank_{M}mb_order.csv"
                _dump_order(sched.pipeline_order, path)
                invalid = _validate(sched.pipeline_order, ranks, ranks, M)
                note(
                    path,
                    cls=cls.__name__,
                    form="pipeline_order",
                    ranks=ranks,
                    stages=ranks,
                    microbatches=M,
                    pytorch_invalid=invalid,
                )

    for ranks, M in INVALID_1F1B:
        half_built = S.Schedule1F1B.__new__(S.Schedule1F1B)
        try:
            S.Schedule1F1B.__init__(half_built, _Stage(0, ranks, ranks, 0), M, loss_fn=_loss)
        except ValueError as e:
            refused = str(e)
        else:
            sys.exit(f"Schedule1F1B accepted {M} microbatches on {ranks} ranks")
        path = HERE / f"1f1b_{ranks}rank_{M}mb_order.csv"
        _dump_order(half_built.pipeline_order, path)
        note(
            path,
            cls="Schedule1F1B",
            form="pipeline_order",
            ranks=ranks,
            stages=ranks,
            microbatches=M,
            pytorch_invalid=_validate(half_built.pipeline_order, ranks, ranks, M),
            pytorch_constructor_refused=" ".join(refused.split()),
        )

    manifest = dict(sorted(manifest.items()))
    (HERE / "manifest.json").write_text(
        json.dumps({"torch": torch.__version__, "files": manifest}, indent=1) + "\n"
    )
    total = sum(p.stat().st_size for p in HERE.glob("*.csv"))
    print(f"wrote {len(manifest)} files, {total} bytes of CSV")


if __name__ == "__main__":
    main()
