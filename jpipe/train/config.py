"""The trainer's config: one conversion at the boundary, into frozen dataclasses.

`TrainConfig.from_config` turns the `ml_collections.ConfigDict` of a
``configs/*.py`` file into typed, frozen dataclasses that check every field
and raise `ConfigError` naming the field, the value and what is accepted.
A ``plan`` field naming a plan file (``python -m jpipe.plan ... --save FILE``)
sets the mesh, the layers per stage, the schedule, its chunks, the
microbatches, the batch and the lowering (``mpmd`` for a plan checked per
rank, ``--memory-layout mpmd``) from that file first
(`jpipe.planner.read_plan_file`).
Checks that need the schedule, the devices or the corpus happen in
`jpipe.train.prepare`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any

import ml_collections

import jpipe
from jpipe.lower.interface import lowering_kind
from jpipe.lower.spmd.ticks import LAYOUTS as TICK_LAYOUTS
from jpipe.models import gpt
from jpipe.runtime.distributed import num_processes, process_index
from jpipe.train import data as data_lib


class ConfigError(ValueError):
    """A config value that cannot work; raised before anything is compiled."""


def config_error(field: str, value, problem: str) -> ConfigError:
    """``config.FIELD=VALUE: PROBLEM``, for people."""
    return ConfigError(f"config.{field}={value!r}: {problem}")


def _check_int(field: str, value, minimum: int) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise config_error(field, value, f"must be {what}")
    return int(value)


def _check_float(field: str, value, lo: float, hi: float, *, lo_open=False, hi_open=False):
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        raise config_error(field, value, "must be a finite number")
    if (value <= lo if lo_open else value < lo) or (value >= hi if hi_open else value > hi):
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        raise config_error(field, value, f"must be in {interval}")
    return float(value)


def _check_type(field: str, value, kind: type, accepted: str):
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise config_error(field, value, f"must be {accepted}")
    return value


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The device mesh: ``pipe`` ranks x ``data`` replicas x ``fsdp`` x ``tensor``.

    ``fsdp`` splits the batch like ``data`` and also every parameter,
    gradient and optimizer state (ZeRO-3); ``tensor`` splits each block
    Megatron-style (`jpipe.models.gpt.tensor_specs`). See `jpipe.make_mesh`
    for where each axis goes.

    ``pipe_hosts`` and ``data_hosts`` say across how many hosts (processes)
    each axis spans, the rest of it staying within a host (see
    `jpipe.make_mesh` and docs/multihost.md); 0 for both leaves the default
    order, which puts ``pipe`` across hosts first.

    ``tensor_per_rank`` (e.g. ``"1,2,2"``) gives each pipeline rank a tensor
    degree of its own, for the per-rank lowering (``lowering="mpmd"``);
    ``""`` (the default) gives every rank ``tensor``. ``tensor`` is then the
    largest of them. The per-rank lowering gives each rank a mesh of its own
    (`jpipe.make_rank_meshes`, `TrainConfig.rank_tensors`) either way.
    """

    pipe: int = 1
    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    pipe_hosts: int = 0
    data_hosts: int = 0
    tensor_per_rank: str = ""

    def __post_init__(self):
        _check_int("mesh.pipe", self.pipe, 1)
        _check_int("mesh.data", self.data, 1)
        _check_int("mesh.fsdp", self.fsdp, 1)
        _check_int("mesh.tensor", self.tensor, 1)
        _check_int("mesh.pipe_hosts", self.pipe_hosts, 0)
        _check_int("mesh.data_hosts", self.data_hosts, 0)
        for axis, size, hosts in (
            ("pipe", self.pipe, self.pipe_hosts),
            ("data", self.data, self.data_hosts),
        ):
            if hosts and size % hosts:
                raise config_error(
                    f"mesh.{axis}_hosts",
                    hosts,
                    f"must divide mesh.{axis}={size} (each host holds an equal part of the axis)",
                )
        degrees = self.rank_tensors
        if degrees is not None:
            if len(degrees) != self.pipe or min(degrees) < 1:
                raise config_error(
                    "mesh.tensor_per_rank",
                    self.tensor_per_rank,
                    "must give a tensor degree of at least 1 for each of the "
                    f"mesh.pipe={self.pipe} ranks, comma-separated (e.g. '1,2,2')",
                )
            if self.tensor not in (1, max(degrees)):
                raise config_error(
                    "mesh.tensor",
                    self.tensor,
                    f"conflicts with mesh.tensor_per_rank={self.tensor_per_rank!r}; accepted: "
                    f"1 or {max(degrees)} (the largest rank's)",
                )
            if self.pipe_hosts or self.data_hosts:
                raise config_error(
                    "mesh.tensor_per_rank",
                    self.tensor_per_rank,
                    "takes each rank's devices in order, which mesh.pipe_hosts and "
                    "mesh.data_hosts do not apply to; accepted: both 0",
                )

    @property
    def rank_tensors(self) -> tuple[int, ...] | None:
        """Each rank's tensor degree (``tensor_per_rank``); None when all have ``tensor``."""
        if not isinstance(self.tensor_per_rank, str):
            raise config_error(
                "mesh.tensor_per_rank", self.tensor_per_rank, "must be a string such as '1,2,2'"
            )
        if not self.tensor_per_rank.strip():
            return None
        try:
            return tuple(int(t) for t in self.tensor_per_rank.split(","))
        except ValueError:
            raise config_error(
                "mesh.tensor_per_rank",
                self.tensor_per_rank,
                "must be whole numbers separated by commas, one per rank (e.g. '1,2,2')",
            ) from None

    @property
    def max_tensor(self) -> int:
        """The largest tensor degree of any rank."""
        return max(self.rank_tensors or (self.tensor,))

    @property
    def across_hosts(self) -> dict[str, int] | None:
        """`jpipe.make_mesh`'s ``across_hosts``, or None for the default order."""
        if not (self.pipe_hosts or self.data_hosts):
            return None
        return {"pipe": self.pipe_hosts or 1, "data": self.data_hosts or 1}

    @property
    def size(self) -> int:
        """The devices the mesh (or the ranks' meshes together) take."""
        per_rank = self.rank_tensors or (self.tensor,) * self.pipe
        return sum(per_rank) * self.data * self.fsdp

    @property
    def replicas(self) -> int:
        """How many ways the batch's rows are split: ``data * fsdp``."""
        return self.data * self.fsdp


TOKENIZERS = ("bytes", "bpe")  # config.data.tokenizer
OPTIMIZERS = ("adamw", "adam", "sgd", "lion")  # config.optimizer.name (jpipe.train.optimizer)
LR_SCHEDULES = ("warmup_cosine", "warmup_linear", "constant")  # config.optimizer.lr_schedule


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the batches come from.

    ``source`` ``""`` is the text corpus (`jpipe.train.data`): ``path``,
    ``max_bytes`` and ``eval_fraction`` say which text and how much is held
    out, ``tokenizer`` whether its tokens are bytes or BPE tokens
    (`jpipe.train.tokens`: a tokenizer of ``model.vocab_size`` tokens
    trained on the training text, batches loaded with Grain). Any other
    ``source`` names a function of `jpipe.train.sources.DataArgs` (a
    registered name or ``path/to/file.py:function``); the section's other
    fields are then its own options (``options``), passed to it as they are.
    """

    path: str = ""
    max_bytes: int = 0
    eval_fraction: float = 0.1
    source: str = ""
    tokenizer: str = "bytes"
    # Tokens in one row of a batch, for the tokens/s figure: 0 = not stated (the
    # text corpus states its own, model.seq_len; a source's batches give rows/s).
    tokens_per_row: int = 0
    options: Mapping = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        _check_int("data.tokens_per_row", self.tokens_per_row, 0)
        if self.tokenizer not in TOKENIZERS:
            raise config_error(
                "data.tokenizer", self.tokenizer, f"must be one of {', '.join(TOKENIZERS)}"
            )
        _check_type(
            "data.source", self.source, str, "'' (the text corpus) or path/to/file.py:function"
        )
        _check_type("data.path", self.path, str, "a string (files/directories, comma-separated)")
        _check_int("data.max_bytes", self.max_bytes, 0)
        _check_float("data.eval_fraction", self.eval_fraction, 0, 1, lo_open=True, hi_open=True)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """An optax optimizer and learning-rate schedule by name, with global-norm clipping.

    ``name`` is one of `OPTIMIZERS` and ``lr_schedule`` one of `LR_SCHEDULES`
    (`jpipe.train.optimizer` says what each does with the other fields);
    the default, AdamW with linear warm-up and cosine decay, is the one
    every earlier run used.

    With `shard_over_data`, the optimizer's state is split over the ``data``
    axis as well as ``pipe`` (ZeRO stage 1): each data replica keeps and
    updates its share of every bucket whose size the axis divides, and the
    updated parameters are gathered back. Its bytes per device fall as
    1 / data, for one all-gather of the parameters over ``data`` a step.
    """

    learning_rate: float
    warmup_steps: int
    min_lr_ratio: float
    weight_decay: float
    b1: float
    b2: float
    grad_clip_norm: float
    shard_over_data: bool = False
    name: str = "adamw"
    lr_schedule: str = "warmup_cosine"
    momentum: float = 0.9  # sgd's (0: plain SGD)

    def __post_init__(self):
        for field, value, choices in (
            ("optimizer.name", self.name, OPTIMIZERS),
            ("optimizer.lr_schedule", self.lr_schedule, LR_SCHEDULES),
        ):
            if value not in choices:
                raise config_error(field, value, f"must be one of {', '.join(choices)}")
        _check_float("optimizer.momentum", self.momentum, 0, 1, hi_open=True)
        _check_float("optimizer.learning_rate", self.learning_rate, 0, math.inf, lo_open=True)
        _check_int("optimizer.warmup_steps", self.warmup_steps, 0)
        _check_float("optimizer.min_lr_ratio", self.min_lr_ratio, 0, 1)
        _check_float("optimizer.weight_decay", self.weight_decay, 0, math.inf)
        _check_float("optimizer.b1", self.b1, 0, 1, hi_open=True)
        _check_float("optimizer.b2", self.b2, 0, 1, hi_open=True)
        _check_float("optimizer.grad_clip_norm", self.grad_clip_norm, 0, math.inf)
        if not isinstance(self.shard_over_data, bool):
            raise ConfigError(
                f"config.optimizer.shard_over_data={self.shard_over_data!r}: must be True or False"
            )


def config_from_file(path) -> ml_collections.ConfigDict:
    """The ``get_config()`` of a config file such as ``configs/default.py``, loaded by path.

    Config files are modules loaded by path, as ml_collections' config flags
    load them, not imported from a package; a config that changes a few
    fields of another starts from ``config_from_file(that file)``.
    """
    import importlib.util
    import os

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    name = "_jpipe_config_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


_SHORTHANDS = {"--config.model=": "--config.model.name=", "--config.data=": "--config.data.source="}


def expand_shorthands(argv) -> list[str]:
    """`argv` with ``--config.model=SPEC`` as ``--config.model.name=SPEC`` (and data's source).

    ``config.model`` and ``config.data`` are sections, which a flag cannot
    replace by a string; ``--config.model=examples/vit_linen.py:build`` (or
    ``=llama``) and ``--config.data=file.py:fn`` mean their ``name`` and
    ``source``.
    """
    out = []
    for arg in argv:
        for short, full in _SHORTHANDS.items():
            if arg.startswith(short):
                arg = full + arg[len(short) :]
        out.append(arg)
    return out


def unknown_override(argv, default_config: str) -> str | None:
    """The first ``--config.FIELD=...`` in `argv` that names no field, as one line.

    ml_collections raises a bare ``AttributeError`` deep inside flag parsing
    for such a typo; this names the flag and the config's nearest fields
    (`difflib`). `default_config` is the file used when `argv` gives no
    ``--config``. None when every override names a field (or the config
    file cannot be read, so that its own error shows).
    """
    import difflib

    path, overrides = default_config, []
    args = list(argv[1:])
    for i, arg in enumerate(args):
        if arg == "--":
            break
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        elif arg == "--config" and i + 1 < len(args):
            path = args[i + 1]
        elif arg.startswith("--config."):
            overrides.append(arg.split("=", 1)[0][len("--config.") :])
        elif arg.startswith("--noconfig."):  # a boolean override
            overrides.append(arg[len("--noconfig.") :])
    if not overrides:
        return None
    try:
        config = config_from_file(path)
    except Exception:
        return None

    def fields(node, prefix=""):
        for key, value in node.items():
            yield prefix + key
            if isinstance(value, ml_collections.ConfigDict | dict):
                yield from fields(value, f"{prefix}{key}.")

    known = list(fields(config))
    for field in overrides:
        if field in known:
            continue
        leaf = field.rsplit(".", 1)[-1]
        near = difflib.get_close_matches(field, known, n=3, cutoff=0.6)
        near += [
            k
            for k in known
            if k not in near and difflib.get_close_matches(leaf, [k.split(".")[-1]])
        ]
        hint = (
            f"nearest: {', '.join('config.' + k for k in near[:3])}"
            if near
            else "see the file for every field"
        )
        return f"--config.{field}: {path} has no field {field!r}; {hint}"
    return None


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs, checked field by field.

    The fields are those of ``configs/default.py``, where each is explained.
    Cross-field checks that need the schedule or the devices happen in
    `prepare`.
    """

    schedule: str
    num_microbatches: int
    steps: int
    log_every: int
    eval_every: int
    eval_batches: int
    checkpoint_every: int
    seed: int
    batch_size: int
    mesh: MeshConfig
    data: DataConfig
    model: Any  # the model's config: gpt.GPTConfig, a registered model's, or a FrozenConfigDict
    optimizer: OptimizerConfig
    chunks: int = 0  # 0: the schedule's own default
    tick_layout: str = "auto"  # "auto", "unit" or "packed" (see jpipe.Pipeline)
    lowering: str = "spmd"  # "spmd" or "mpmd" (per rank; see jpipe.Pipeline)
    layers_per_stage: str = ""
    cpu_devices: int = 0
    profile: bool = False
    plan: str = ""  # a jpipe plan file; its settings were applied by from_config
    trust_plan: bool = False  # may the plan name code (a file.py:fn schedule); docs/trust.md
    model_name: str = "gpt"  # config.model.name: a registered model or path/to/file.py:function
    # Start from these parameters instead of model.init: a run directory (its newest
    # checkpoint) or a .npz file from jpipe.train.save_params (jpipe.train.export).
    init_from: str = ""
    eval_fn: str = ""  # path/to/file.py:function, fn(params, batch) -> {name: float}; "" = none
    # Compile the train step from shapes and report each device's bytes instead of
    # training (jpipe.train.compile_only); the memory a device has, in bytes ("80GB",
    # "72GiB", 8e10) or a device kind of jpipe's planner ("A100-80").
    compile_only: bool = False
    compile_only_device_memory: str | float = "80GB"
    compile_only_predict: bool = True  # also jpipe's byte model's figure (predicted_bytes)

    def __post_init__(self):
        _check_type("compile_only", self.compile_only, bool, "True or False")
        _check_type("compile_only_predict", self.compile_only_predict, bool, "True or False")
        device_memory_bytes(self.compile_only_device_memory)  # raises ConfigError naming it
        _check_type("eval_fn", self.eval_fn, str, "'' or path/to/file.py:function")
        from jpipe.models.registry import is_file_spec

        if self.eval_fn and not is_file_spec(self.eval_fn):
            raise config_error(
                "eval_fn",
                self.eval_fn,
                "must be path/to/file.py:function (a function of the model's parameters and a "
                "held-out batch returning {name: float}), or '' for none",
            )
        _check_type(
            "schedule", self.schedule, str, "a schedule name, a .csv file or file.py:function"
        )
        if not self.schedule.strip():
            raise config_error("schedule", self.schedule, f"is empty; {_schedule_choices()}")
        _check_int("num_microbatches", self.num_microbatches, 1)
        _check_int("chunks", self.chunks, 0)
        if self.tick_layout not in TICK_LAYOUTS:
            raise config_error(
                "tick_layout", self.tick_layout, f"must be one of {', '.join(TICK_LAYOUTS)}"
            )
        if self.lowering not in jpipe.LOWERINGS:
            raise config_error(
                "lowering", self.lowering, f"must be one of {', '.join(jpipe.LOWERINGS)}"
            )
        _check_type("layers_per_stage", self.layers_per_stage, str, "a string such as '3,4,4,3'")
        _check_int("steps", self.steps, 1)
        _check_int("log_every", self.log_every, 1)
        _check_int("eval_every", self.eval_every, 0)
        _check_int("eval_batches", self.eval_batches, 1)
        _check_int("checkpoint_every", self.checkpoint_every, 0)
        _check_int("seed", self.seed, 0)
        _check_int("batch_size", self.batch_size, 1)
        _check_int("cpu_devices", self.cpu_devices, 0)
        _check_type("profile", self.profile, bool, "True or False")
        _check_type("trust_plan", self.trust_plan, bool, "True or False")
        _check_type(
            "init_from",
            self.init_from,
            str,
            "'' or a run directory or .npz file of parameters (jpipe.train.save_params)",
        )
        if self.profile and not lowering_kind(self.lowering).one_program:
            raise config_error(
                "profile",
                self.profile,
                "measures the SPMD step's memory and stage times; the per-rank lowering's "
                "profile is not built yet; accepted: profile=False with lowering='mpmd'",
            )
        if self.mesh.rank_tensors is not None and not lowering_kind(self.lowering).meshes_per_rank:
            raise config_error(
                "mesh.tensor_per_rank",
                self.mesh.tensor_per_rank,
                "gives the ranks meshes of different shapes, which only the per-rank lowering "
                "runs; accepted with lowering='mpmd'",
            )
        if self.profile and self.mesh.tensor > 1:
            raise config_error(
                "profile",
                self.profile,
                "times each stage's pieces on one device, which a stage split over "
                f"mesh.tensor={self.mesh.tensor} cannot run on; accepted: profile=False "
                "with mesh.tensor > 1",
            )
        byte_text = not self.data.source and self.data.tokenizer == "bytes"
        if (
            byte_text
            and getattr(self.model, "vocab_size", data_lib.VOCAB_SIZE) < data_lib.VOCAB_SIZE
        ):
            raise config_error(
                "model.vocab_size",
                self.model.vocab_size,
                f"the byte-level corpus needs at least {data_lib.VOCAB_SIZE} token ids",
            )

    @property
    def rank_tensors(self) -> tuple[int, ...] | None:
        """Each rank's tensor degree where each rank gets a mesh of its own, else None.

        A mesh per rank with ``mesh.tensor_per_rank``, and by default under
        the per-rank lowering: each rank then holds its own parameters,
        gradients and optimizer state only, where on one mesh every device
        holds its row of every rank's buckets (issue 35: Llama-3-8B's middle
        ranks 13.62 GB of arguments against 10.47 GB of their own). A mesh
        laid across hosts (``mesh.pipe_hosts``, ``mesh.data_hosts``) is one mesh.
        """
        if self.mesh.rank_tensors is not None:
            return self.mesh.rank_tensors
        if lowering_kind(self.lowering).meshes_per_rank and self.mesh.across_hosts is None:
            return (self.mesh.tensor,) * self.mesh.pipe
        return None

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict | Mapping) -> TrainConfig:
        """Converts (and checks) a config such as ``configs/default.py``'s.

        Raises:
          ConfigError: a field is missing, unknown, or has a bad value.
        """
        raw = config.to_dict() if isinstance(config, ml_collections.ConfigDict) else dict(config)
        sections = {
            "mesh": MeshConfig,
            "data": DataConfig,
            "optimizer": OptimizerConfig,
            "model": gpt.GPTConfig,
        }
        kwargs = _fields(cls, {k: v for k, v in raw.items() if k != "model_name"}, "")
        if kwargs.get("plan"):
            kwargs = _apply_plan(kwargs)
        for name, kind in sections.items():
            sub = kwargs.get(name)
            if not isinstance(sub, Mapping):
                raise config_error(name, sub, "must be a section (a ConfigDict)")
            sub = dict(sub)
            if name == "model":
                kwargs["model_name"], kind = _model_kind(sub.pop("name", "gpt"))
                if kind is None:  # a builder from a file: its fields as they are
                    kwargs[name] = ml_collections.FrozenConfigDict(sub)
                    continue
            if name == "data" and sub.get("source"):  # a source function: the rest is its own
                known = {f.name for f in dataclasses.fields(DataConfig)}
                sub["options"] = {k: v for k, v in sub.items() if k not in known}
                sub = {k: v for k, v in sub.items() if k in known}
            sub_kwargs = _fields(kind, sub, f"{name}.")
            try:
                kwargs[name] = kind(**sub_kwargs)
            except ConfigError:
                raise
            except (ValueError, TypeError) as e:  # GPTConfig's own checks
                raise ConfigError(f"config.{name}: {e}") from None
        return cls(**kwargs)


def device_memory_bytes(value) -> tuple[float, str]:
    """``config.compile_only_device_memory`` as ``(bytes, what it said)``.

    A positive number of bytes, a string of bytes with an optional unit
    (``"80GB"``, ``"72GiB"``, ``"8e10"``) or the name of a device kind jpipe's
    planner knows (``"A100-80"``: its memory, `jpipe.planner` ``DEVICE_MEMORY``).

    Raises:
      ConfigError: naming the field, when it is none of these.
    """
    from jpipe.planner.profiles import DEVICE_MEMORY

    field = "compile_only_device_memory"
    kinds = ", ".join(DEVICE_MEMORY)
    accepted = (
        f"accepted: bytes (a number, or a string such as '80GB' or '72GiB') or a device kind "
        f"jpipe's planner knows ({kinds})"
    )
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        if not (math.isfinite(value) and value > 0):
            raise config_error(field, value, f"must be positive; {accepted}")
        return float(value), f"{float(value):.4g} bytes"
    if not isinstance(value, str):
        raise config_error(field, value, accepted)
    if value.strip() in DEVICE_MEMORY:
        return float(DEVICE_MEMORY[value.strip()]), value.strip()
    from jpipe.search.cli import parse_bytes

    try:
        return parse_bytes(value), value.strip()
    except ValueError:
        raise config_error(
            field, value, f"is neither bytes nor a known device kind; {accepted}"
        ) from None


def _model_kind(name) -> tuple[str, type | None]:
    """``config.model.name`` checked: the name and its config class (None for a file's)."""
    _check_type("model.name", name, str, "a registered model name or path/to/file.py:function")
    from jpipe.models import registry

    try:
        return name, registry.get_model(name)[1]
    except ValueError as e:
        raise config_error("model.name", name, str(e)) from None


def _read_plan(path):
    _check_type("plan", path, str, "the path of a plan file (python -m jpipe.plan ... --save FILE)")
    try:
        return jpipe.planner.read_plan_file(path)
    except ValueError as e:
        raise config_error("plan", path, str(e)) from None


def _apply_plan(kwargs: dict) -> dict:
    """The config with the plan file's mesh, split, schedule, microbatches and batch."""
    path = kwargs["plan"]
    settings = _read_plan(path)
    trusted = _check_type("trust_plan", kwargs.get("trust_plan", False), bool, "True or False")
    from jpipe.schedule.registry import names_code

    # A plan file is data: the code it names runs only if the user says so, by trusting
    # the file or by naming the same schedule themselves (docs/trust.md).
    if (
        names_code(settings.schedule)
        and not trusted
        and kwargs.get("schedule") != settings.schedule
    ):
        raise config_error(
            "plan",
            path,
            f"its schedule {settings.schedule!r} is code (a Python file train.py would import "
            "and run), and a plan file is data; accepted: --config.trust_plan=True if you "
            f"trust this file, or --config.schedule={settings.schedule} to name it yourself",
        )
    model = kwargs.get("model")
    blocks = sum(settings.layers_per_stage)
    if isinstance(model, Mapping) and model.get("num_layers") != blocks:
        raise config_error(
            "plan",
            path,
            f"splits {blocks} transformer blocks over its stages but config.model.num_layers="
            f"{model.get('num_layers')}; set config.model.num_layers={blocks} or plan this model",
        )
    hosts, running = settings.process_devices, num_processes()
    if hosts and settings.tensor_per_rank and running > 1 and running != len(hosts):
        raise config_error(
            "plan",
            path,
            f"runs as {len(hosts)} process(es), one per host (with {list(hosts)} devices), but "
            f"this run has {running}; start it with python -m jpipe.launch --plan {path} -- "
            f"train.py --config.plan={path} on one machine, or one process per host in the "
            "plan's order (docs/multihost.md)",
        )
    mesh = dict(kwargs.get("mesh") or {})
    mesh.update(pipe=settings.pipe, data=settings.data, tensor=settings.tensor)
    if settings.tensor_per_rank is not None:  # a degree per rank (an mpmd plan)
        mesh["tensor_per_rank"] = ",".join(str(t) for t in settings.tensor_per_rank)
    return {
        **kwargs,
        "mesh": mesh,
        "schedule": settings.schedule,
        "chunks": settings.num_chunks,
        "num_microbatches": settings.num_microbatches,
        "batch_size": settings.batch_size,
        "layers_per_stage": ",".join(str(b) for b in settings.layers_per_stage),
        # A plan checked per rank (each device its own rank's memory) runs per rank.
        "lowering": settings.lowering,
    }


def _fields(kind: type, raw: dict, prefix: str) -> dict:
    """`raw` checked against `kind`'s fields: none unknown, none required missing."""
    fields = {f.name: f for f in dataclasses.fields(kind)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown config field(s) {', '.join('config.' + prefix + u for u in unknown)}; "
            f"the fields are {', '.join(prefix + f for f in fields)}"
        )
    required = dataclasses.MISSING
    missing = [
        n
        for n, f in fields.items()
        if n not in raw and f.default is required and f.default_factory is required
    ]
    if missing:
        raise ConfigError(
            f"config is missing {', '.join('config.' + prefix + m for m in missing)} "
            "(see configs/default.py for every field)"
        )
    return dict(raw)


def _schedule_choices() -> str:
    names = ", ".join(jpipe.registered_schedules())
    return f"accepted: a built-in name ({names}), a PyTorch .csv file, or path/to/file.py:function"


def use_cpu_devices(config: ml_collections.ConfigDict | Mapping) -> int | None:
    """Fakes enough CPU devices for the config's mesh, before JAX starts its backends.

    Call it first thing, before any JAX computation (after
    `jpipe.initialize_distributed` in a multi-process run): it asks for
    ``config.cpu_devices`` CPU devices in this process or, when that is 0,
    the mesh's size (the plan file's mesh when ``config.plan``
    names one) divided among the processes (see `jpipe.use_cpu_devices`), or
    where the plan lists its processes (a per-rank plan), this process's.

    Returns:
      The CPU device count set, or None when JAX had already started (the
      setting can then no longer change) or the config does not say.
    """
    get = config.get if isinstance(config, Mapping | ml_collections.ConfigDict) else None
    mesh = get("mesh") if get else None
    try:
        if get("plan", ""):  # the plan file's mesh is the one the run will use
            settings = jpipe.planner.read_plan_file(get("plan"))
            mesh = {"pipe": settings.pipe, "data": settings.data, "tensor": settings.tensor}
            if settings.tensor_per_rank:
                mesh["tensor_per_rank"] = ",".join(map(str, settings.tensor_per_rank))
            here = settings.process_devices
            if not int(get("cpu_devices", 0) or 0) and here and len(here) == num_processes():
                # The plan's hosts hold different numbers of devices: this process's.
                return jpipe.use_cpu_devices(here[process_index()])
        per_rank = str(mesh.get("tensor_per_rank", "") or "")
        tensors = (
            [int(t) for t in per_rank.split(",")]
            if per_rank.strip()
            else [int(mesh.get("tensor", 1) or 1)] * int(mesh["pipe"])
        )
        size = sum(tensors) * int(mesh["data"]) * int(mesh.get("fsdp", 1) or 1)
        n = int(get("cpu_devices", 0) or 0) or -(-size // num_processes())
    except (TypeError, KeyError, ValueError):
        return None  # `train` reports the bad field properly
    if n < 1:
        return None
    return jpipe.use_cpu_devices(n)
