"""Models by name: the builders the trainer's ``config.model.name`` picks.

A builder is a function ``build(args: BuildArgs) -> StagedModel``: given the
model's own config and what the run decided (how many stages, how the layers
go over them, the tensor axis if any), it returns the stage functions, their
initializer, their `PartitionSpec`s and the reference loss. ``"gpt"`` and
``"llama"`` are registered here, by their own modules (which the package
imports, so this module never imports them); any other is named
``"path/to/file.py:function"`` and loaded from that file, the way schedules
are.

A registered builder may come with a config class (a frozen dataclass that
checks its fields, such as `GPTConfig`); the trainer then converts
``config.model``'s fields into it. A builder from a file gets the fields as
they are, in a `ml_collections.FrozenConfigDict`.
"""

from __future__ import annotations

import importlib.util
import keyword
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
    """The registered model names, sorted.

    The built-ins are here already: Python runs the package `jpipe.models`,
    which imports `jpipe.models.gpt` and `jpipe.models.llama` (each registers
    itself), before any of its modules, this one included.
    """
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

    The file is imported under its own module name, its stem (``mine.py``
    is module ``mine``), as ``import mine`` would import it, so the classes
    it defines (a model's dataclasses, Equinox or NNX modules) are the
    classes of the user's ``import mine``, and pytrees made by jpipe compare
    equal, in structure and type, with pytrees the user makes:

    - a module already imported from this same file, under any name but
      ``__main__`` (``mine``, ``pkg.mine``), is used as it is, not run again
      (edit the file and ``importlib.reload`` it to see the change);
    - otherwise the file runs once and is kept as ``sys.modules["mine"]``,
      so a later ``import mine`` gets this module;
    - where the stem is not a module name (``my-model.py``), is taken by
      another module already imported (two files ``a/model.py`` and
      ``b/model.py``: the first loaded keeps ``model``), or would shadow
      another importable module (a file named ``json.py``), the file runs
      under a private name made from its path instead,
      ``_jpipe_user_<path>``, as ``import`` could not reach it by its stem
      either (and a later load finds it there, by its file, as above).

    Raises:
      ValueError: the file does not exist, or has no such function.
    """
    path, _, name = spec.rpartition(":")
    if not os.path.isfile(path):
        raise ValueError(f"{what} {spec!r}: the file {path!r} does not exist")
    module = _import_file(os.path.realpath(path))
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ValueError(
            f"{what} {spec!r}: {path} has no function {name!r}"
            + (f" (it has {', '.join(found)})" if found else "")
        )
    return fn


def _module_file(module) -> str | None:
    """The real path of the file `module` was loaded from, or None."""
    file = getattr(module, "__file__", None)
    try:
        return os.path.realpath(file) if isinstance(file, str) else None
    except (OSError, ValueError):
        return None


def _import_file(full: str):
    """The module of the file `full` (a real path), imported as `load_function` says."""
    for module_name, module in list(sys.modules.items()):
        if module_name != "__main__" and module is not None and _module_file(module) == full:
            return module  # imported before, by the user or by an earlier load
    stem = os.path.splitext(os.path.basename(full))[0]
    private = "_jpipe_user_" + "".join(c if c.isalnum() else "_" for c in full)
    module_name = stem if _stem_is_free(stem, full) else private
    module_spec = importlib.util.spec_from_file_location(module_name, full)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses, pickling and `import` look the module up
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module


def _stem_is_free(stem: str, full: str) -> bool:
    """Whether `full` may be imported as module `stem` without hiding another module."""
    if not stem.isidentifier() or keyword.iskeyword(stem) or stem in sys.modules:
        return False
    try:
        found = importlib.util.find_spec(stem)
    except (ImportError, ValueError):
        return False
    # Nothing else answers to the name, or `import stem` would find this very file.
    return found is None or (found.origin is not None and os.path.realpath(found.origin) == full)
