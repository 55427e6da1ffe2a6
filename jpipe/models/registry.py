"""Models by name: the builders the trainer's ``config.model.name`` picks.

A builder is a function ``build(args: BuildArgs) -> StagedModel``: given the
model's own config and what the run decided (how many stages, how the layers
go over them, the tensor axis if any), it returns the stage functions, their
initializer, their `PartitionSpec`s and the reference loss. ``"gpt"`` and
``"llama"`` are registered here; any other is named
``"path/to/file.py:function"`` and loaded from that file, the way schedules
are.

A registered builder may come with a config class (a frozen dataclass that
checks its fields, such as `GPTConfig`); the trainer then converts
``config.model``'s fields into it. A builder from a file gets the fields as
they are, in a `ml_collections.FrozenConfigDict`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

from jpipe.models.staged import StagedModel


class BuildArgs(NamedTuple):
    """What a model builder gets.

    Attributes:
      config: the model's config: ``config.model``'s fields other than
        ``name`` (a registered model's config class, else a
        `ml_collections.FrozenConfigDict`).
      num_stages: S, the schedule's number of stages.
      layers_per_stage: ``config.layers_per_stage``: ``""`` for balanced, or
        counts such as ``"3,4,4,3"``.
      tensor_axis: the mesh axis to split each stage over (``"tensor"``), or
        None; with one, the stages run their own collectives over it and
        `StagedModel.specs` must say how each array is split.
    """

    config: Any
    num_stages: int
    layers_per_stage: str = ""
    tensor_axis: str | None = None


Builder = Callable[[BuildArgs], StagedModel]

_MODELS: dict[str, tuple[Builder, type | None]] = {}


def register_model(name: str, config_class: type | None = None):
    """Registers ``build(args) -> StagedModel`` under `name` (a decorator).

    Args:
      name: what ``config.model.name`` says.
      config_class: a dataclass the model's config fields are converted into
        (it checks them); None passes them as a frozen ConfigDict.
    """

    def register(build: Builder) -> Builder:
        if name in _MODELS and _MODELS[name][0] is not build:
            raise ValueError(f"a model named {name!r} is already registered; choose another name")
        _MODELS[name] = (build, config_class)
        return build

    return register


def registered_models() -> tuple[str, ...]:
    """The registered model names, sorted."""
    import jpipe.models  # noqa: F401  (registers the built-in models)

    return tuple(sorted(_MODELS))


def is_file_spec(spec: str) -> bool:
    """Whether `spec` names a function in a file: ``path/to/file.py:function``."""
    path, sep, _ = spec.rpartition(":")
    return bool(sep) and path.endswith(".py")


def get_model(spec: str) -> tuple[Builder, type | None]:
    """The builder `spec` names and its config class (None for a builder from a file).

    Raises:
      ValueError: no such name, file or function.
    """
    if is_file_spec(spec):
        return load_function(spec, "model builder"), None
    registered_models()
    if spec not in _MODELS:
        raise ValueError(
            f"unknown model {spec!r}: use one of {', '.join(sorted(_MODELS))} or "
            "path/to/file.py:function (a function build(args) -> jpipe.models.StagedModel)"
        )
    return _MODELS[spec]


def build_model(spec: str, args: BuildArgs) -> StagedModel:
    """Builds the model `spec` names (see `get_model`) and checks what it returned.

    Raises:
      ValueError: the builder is unknown, raised ValueError itself, or
        returned something other than a `StagedModel` with `args.num_stages`
        stages.
    """
    build, _ = get_model(spec)
    model = build(args)
    if not isinstance(model, StagedModel):
        raise ValueError(
            f"the model builder {spec} returned a {type(model).__name__}; it must return a "
            "jpipe.models.StagedModel (split_flax_model, split_nnx_model, or your own)"
        )
    if len(model.stages) != args.num_stages:
        raise ValueError(
            f"the model builder {spec} returned {len(model.stages)} stages but the schedule has "
            f"{args.num_stages}; build args.num_stages stages"
        )
    return model


def load_function(spec: str, what: str) -> Callable:
    """The function ``name`` of the Python file ``path`` in ``"path:name"``.

    The file is executed as a fresh module each time (under a name made from
    its absolute path), so a file that was imported or loaded before loads
    again, with its current contents.

    Raises:
      ValueError: the file does not exist, or has no such function.
    """
    path, _, name = spec.rpartition(":")
    if not os.path.isfile(path):
        raise ValueError(f"{what} {spec!r}: the file {path!r} does not exist")
    full = os.path.abspath(path)
    module_name = "_jpipe_user_" + "".join(c if c.isalnum() else "_" for c in full)
    module_spec = importlib.util.spec_from_file_location(module_name, full)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ValueError(
            f"{what} {spec!r}: {path} has no function {name!r}"
            + (f" (it has {', '.join(found)})" if found else "")
        )
    return fn
