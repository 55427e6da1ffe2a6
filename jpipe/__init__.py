"""jpipe: write, check, see and run pipeline-parallel training schedules in JAX.

The data flows one way: a schedule (Python or PyTorch CSV) -> `validate` ->
`simulate` and charts -> a program lowered onto a device mesh (one SPMD
program, or one program per rank) -> a train step. Everything before the
lowering is pure Python and needs no devices.

Glossary for shapes and sizes, used throughout: S stages, R ranks (devices on
the ``pipe`` mesh axis), V chunks (stages) per rank, M microbatches, B
microbatch size, L sequence length, D model width.

The names here are the user's words, each under the name its module gives
it. Names are imported when first used (PEP 562 `__getattr__`), so ``import
jpipe`` and the schedule language do not import JAX: ``python -m jpipe.show``
starts in a fraction of a second. The ``TYPE_CHECKING`` block below is the
same list for static tools; `tests/test_public_api.py` keeps the two equal.

Apart from these: the subpackages `jpipe.models`, `jpipe.train`,
`jpipe.planner` (planning for mixed devices) and `jpipe.testing` (the
checker a user's tests call), reachable after ``import jpipe``; and the
compiler's rooms, `jpipe.schedule`, `jpipe.stage`, `jpipe.lower`,
`jpipe.search` and `jpipe.runtime`, which tests and new passes import by
module (docs/layout.md), with no promise that their names stay.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Each public name and the module that defines it under that name.
_EXPORTS = {
    # The schedule language: actions, schedules, checks, names
    "Action": "jpipe.schedule.actions",
    "F": "jpipe.schedule.actions",
    "B": "jpipe.schedule.actions",
    "I": "jpipe.schedule.actions",
    "W": "jpipe.schedule.actions",
    "FC": "jpipe.schedule.actions",
    "Overlap": "jpipe.schedule.actions",
    "LOAD": "jpipe.schedule.actions",
    "EVICT": "jpipe.schedule.actions",
    "OFFLOAD_START": "jpipe.schedule.actions",
    "OFFLOAD_END": "jpipe.schedule.actions",
    "RELOAD_START": "jpipe.schedule.actions",
    "RELOAD_END": "jpipe.schedule.actions",
    "RECOMPUTE": "jpipe.schedule.actions",
    "MEMORY_KINDS": "jpipe.schedule.actions",
    "Schedule": "jpipe.schedule.actions",
    "ScheduleError": "jpipe.schedule.validate",
    "validate": "jpipe.schedule.validate",
    "get_schedule": "jpipe.schedule.registry",
    "register_schedule": "jpipe.schedule.registry",
    "registered_schedules": "jpipe.schedule.registry",
    # Seeing a schedule: time, bubble and bytes
    "Costs": "jpipe.schedule.events",
    "Simulation": "jpipe.schedule.simulate",
    "Sizes": "jpipe.schedule.simulate",
    "simulate": "jpipe.schedule.simulate",
    # Running it: a pipeline over a mesh, and the model without one
    "LOWERINGS": "jpipe.lower.pipeline",
    "Pipeline": "jpipe.lower.pipeline",
    "make_mesh": "jpipe.lower.pipeline",
    "make_rank_meshes": "jpipe.lower.pipeline",
    "reference_value_and_grad": "jpipe.lower.pipeline",
    "run_stages": "jpipe.lower.pipeline",
    "microbatches": "jpipe.lower.microbatch",
    "split_microbatches": "jpipe.lower.microbatch",
    "StageKernels": "jpipe.stage.pieces",
    "WeightedLoss": "jpipe.stage.pieces",
    # What a compiled step is made of (returned by Pipeline.tick_plan, .program, .rank_programs)
    "TickPlan": "jpipe.lower.spmd.ticks",
    "make_tick_plan": "jpipe.lower.spmd.ticks",
    "Program": "jpipe.lower.spmd.program",
    "RankPrograms": "jpipe.lower.mpmd.programs",
    # Devices and processes
    "describe_devices": "jpipe.runtime.devices",
    "use_cpu_devices": "jpipe.runtime.devices",
    "exit_distributed": "jpipe.runtime.distributed",
    "initialize_distributed": "jpipe.runtime.distributed",
    "launch_local": "jpipe.runtime.launch",
    # A memory budget: the fastest schedule that fits
    "LayerProfile": "jpipe.search.engine",
    "ScheduleSearch": "jpipe.search.engine",
    "StageFigures": "jpipe.search.engine",
    "StageProfile": "jpipe.search.engine",
    "load_stage_profile": "jpipe.search.engine",
    "search_schedule": "jpipe.search.engine",
}
_SUBPACKAGES = (
    "lower",
    "models",
    "planner",
    "planning",
    "runtime",
    "schedule",
    "search",
    "stage",
    "testing",
    "train",
)

if TYPE_CHECKING:  # the same names, for static tools; one import per name
    from jpipe.lower.microbatch import microbatches as microbatches
    from jpipe.lower.microbatch import split_microbatches as split_microbatches
    from jpipe.lower.mpmd.programs import RankPrograms as RankPrograms
    from jpipe.lower.pipeline import LOWERINGS as LOWERINGS
    from jpipe.lower.pipeline import Pipeline as Pipeline
    from jpipe.lower.pipeline import make_mesh as make_mesh
    from jpipe.lower.pipeline import make_rank_meshes as make_rank_meshes
    from jpipe.lower.pipeline import reference_value_and_grad as reference_value_and_grad
    from jpipe.lower.pipeline import run_stages as run_stages
    from jpipe.lower.spmd.program import Program as Program
    from jpipe.lower.spmd.ticks import TickPlan as TickPlan
    from jpipe.lower.spmd.ticks import make_tick_plan as make_tick_plan
    from jpipe.runtime.devices import describe_devices as describe_devices
    from jpipe.runtime.devices import use_cpu_devices as use_cpu_devices
    from jpipe.runtime.distributed import exit_distributed as exit_distributed
    from jpipe.runtime.distributed import initialize_distributed as initialize_distributed
    from jpipe.runtime.launch import launch_local as launch_local
    from jpipe.schedule.actions import EVICT as EVICT
    from jpipe.schedule.actions import FC as FC
    from jpipe.schedule.actions import LOAD as LOAD
    from jpipe.schedule.actions import MEMORY_KINDS as MEMORY_KINDS
    from jpipe.schedule.actions import OFFLOAD_END as OFFLOAD_END
    from jpipe.schedule.actions import OFFLOAD_START as OFFLOAD_START
    from jpipe.schedule.actions import RECOMPUTE as RECOMPUTE
    from jpipe.schedule.actions import RELOAD_END as RELOAD_END
    from jpipe.schedule.actions import RELOAD_START as RELOAD_START
    from jpipe.schedule.actions import Action as Action
    from jpipe.schedule.actions import B as B
    from jpipe.schedule.actions import F as F
    from jpipe.schedule.actions import I as I
    from jpipe.schedule.actions import Overlap as Overlap
    from jpipe.schedule.actions import Schedule as Schedule
    from jpipe.schedule.actions import W as W
    from jpipe.schedule.events import Costs as Costs
    from jpipe.schedule.registry import get_schedule as get_schedule
    from jpipe.schedule.registry import register_schedule as register_schedule
    from jpipe.schedule.registry import registered_schedules as registered_schedules
    from jpipe.schedule.simulate import Simulation as Simulation
    from jpipe.schedule.simulate import Sizes as Sizes
    from jpipe.schedule.simulate import simulate as simulate
    from jpipe.schedule.validate import ScheduleError as ScheduleError
    from jpipe.schedule.validate import validate as validate
    from jpipe.search.engine import LayerProfile as LayerProfile
    from jpipe.search.engine import ScheduleSearch as ScheduleSearch
    from jpipe.search.engine import StageFigures as StageFigures
    from jpipe.search.engine import StageProfile as StageProfile
    from jpipe.search.engine import load_stage_profile as load_stage_profile
    from jpipe.search.engine import search_schedule as search_schedule
    from jpipe.stage.pieces import StageKernels as StageKernels
    from jpipe.stage.pieces import WeightedLoss as WeightedLoss

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"jpipe.{name}")
    else:
        raise AttributeError(f"module 'jpipe' has no attribute {name!r}")
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBPACKAGES))
