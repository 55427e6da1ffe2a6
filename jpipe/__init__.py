"""jpipe: write, check, see and run pipeline-parallel training schedules in JAX.

The data flows one way: a schedule (Python or PyTorch CSV) -> `validate` ->
`simulate` and charts -> `make_plan` (lock-step ticks and buffer slots) -> a
program lowered onto a device mesh -> a train step.
Everything before the lowering is pure Python and needs no devices.

Glossary for shapes and sizes, used throughout: S stages, R ranks (devices on
the ``pipe`` mesh axis), V chunks (stages) per rank, M microbatches, B
microbatch size, L sequence length, D model width.
"""

from jpipe._devices import describe_devices, use_cpu_devices
from jpipe._distributed import exit_now as exit_distributed
from jpipe._distributed import initialize as initialize_distributed
from jpipe._launch import launch as launch_local
from jpipe._lower import Program
from jpipe._partition import partition as partition_layers
from jpipe._pipeline import (
    Pipeline,
    make_mesh,
    microbatches,
    reference_value_and_grad,
    run_stages,
    split_microbatches,
)
from jpipe._plan import LAYOUTS as TICK_LAYOUTS
from jpipe._plan import Plan, Transfers, make_plan, pack_lifetimes
from jpipe._planner import ClusterPlan, DeviceGroup, read_plan_file
from jpipe._planner import evaluate as evaluate_plan
from jpipe._planner import plan as plan_cluster
from jpipe._profile import load_sailor_profile
from jpipe._registry import get_schedule, register_schedule, registered_schedules
from jpipe._schedule import Action, B, F, I, Overlap, Schedule, W
from jpipe._simulate import Costs, Simulation, Sizes, simulate
from jpipe._stage import StageKernels, WeightedLoss, stage_pieces
from jpipe._validate import ScheduleError, validate

__all__ = [
    "Action",
    "B",
    "ClusterPlan",
    "Costs",
    "DeviceGroup",
    "F",
    "I",
    "Overlap",
    "Pipeline",
    "Plan",
    "Program",
    "Schedule",
    "ScheduleError",
    "Simulation",
    "Sizes",
    "StageKernels",
    "TICK_LAYOUTS",
    "Transfers",
    "W",
    "WeightedLoss",
    "describe_devices",
    "evaluate_plan",
    "exit_distributed",
    "get_schedule",
    "initialize_distributed",
    "launch_local",
    "load_sailor_profile",
    "make_mesh",
    "make_plan",
    "microbatches",
    "pack_lifetimes",
    "partition_layers",
    "plan_cluster",
    "read_plan_file",
    "reference_value_and_grad",
    "register_schedule",
    "registered_schedules",
    "run_stages",
    "simulate",
    "split_microbatches",
    "stage_pieces",
    "use_cpu_devices",
    "validate",
]
