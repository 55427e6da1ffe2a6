"""Schedules by name: the registry, and turning a SPEC string into a Schedule.

A schedule written in Python is a function
``fn(num_ranks, num_microbatches, num_chunks=1, **options)`` returning one list
of actions per rank. `register_schedule` files it under a name so configs and
command lines can ask for it. A SPEC, as the command-line tools and configs
take it, is one of:

- a registered name, such as ``1f1b`` (the built-ins live in ``schedules/``);
- a path to a PyTorch schedule CSV, such as ``my_schedule.csv``;
- ``path/to/file.py:function`` for a function in a user's own file, which need
  not be registered.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import operator
import os
import pkgutil
import sys
from collections.abc import Callable
from typing import Any

from jpipe._schedule import Schedule

ScheduleFn = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class _Entry:
    fn: ScheduleFn
    doc: str


_REGISTRY: dict[str, _Entry] = {}
_BUILTINS_LOADED = False


def register_schedule(name: str) -> Callable[[ScheduleFn], ScheduleFn]:
    """Registers a schedule function under `name` (a decorator).

    The function takes ``(num_ranks, num_microbatches, num_chunks=1, **options)``
    and returns one list of actions per rank (`jpipe.F` and friends, `Overlap`,
    or strings like ``"2F0"``). Raise `ValueError` with one sentence naming the
    limit when it cannot serve the numbers it is given.
    """

    def decorate(fn: ScheduleFn) -> ScheduleFn:
        existing = _REGISTRY.get(name)
        if existing is not None and (
            existing.fn.__module__,
            existing.fn.__qualname__,
        ) != (fn.__module__, fn.__qualname__):
            raise ValueError(
                f"a schedule named {name!r} is already registered (by "
                f"{existing.fn.__module__}.{existing.fn.__qualname__}); choose another name"
            )
        _REGISTRY[name] = _Entry(fn, inspect.getdoc(fn) or "")
        return fn

    return decorate


def _load_builtins() -> None:
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    _BUILTINS_LOADED = True
    import jpipe.schedules as package  # the repository's schedules/ folder

    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{info.name}")


def registered_schedules() -> dict[str, str]:
    """Every registered schedule name, with the first line of its docstring."""
    _load_builtins()
    return {name: e.doc.split("\n")[0] for name, e in sorted(_REGISTRY.items())}


def _load_file_function(spec: str, what: str = "schedule") -> ScheduleFn:
    path, _, fn_name = spec.rpartition(":")
    if not os.path.isfile(path):
        raise ValueError(f"{what} file {path!r} (from {spec!r}) does not exist")
    module_name = f"_jpipe_user_schedule_{abs(hash(os.path.abspath(path)))}"
    module = sys.modules.get(module_name)
    if module is None:
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            raise ValueError(f"cannot load {path!r}: {type(e).__name__}: {e}") from e
        sys.modules[module_name] = module
    fn = getattr(module, fn_name, None)
    if fn is None or not callable(fn):
        raise ValueError(f"{path!r} has no function named {fn_name!r}")
    return fn


_RENAMED = {"ranks": "num_ranks", "microbatches": "num_microbatches", "chunks": "num_chunks"}


def _check_options(name: str, params, options: dict) -> None:
    """Refuses options the schedule function does not take, naming those it does."""
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    positional = [
        p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    accepted = [p.name for p in positional[2:]] + [
        p.name for p in params.values() if p.kind is p.KEYWORD_ONLY
    ]
    unknown = [key for key in options if key not in accepted]
    if not unknown:
        return
    hints = [f"{_RENAMED[k]}= for {k}=" for k in unknown if k in _RENAMED]
    takes = ", ".join(a for a in accepted if a != "num_chunks") or "none"
    raise ValueError(
        f"schedule {name!r} takes no option {', '.join(map(repr, unknown))}; its options: "
        f"{takes}" + (f" (use {'; '.join(hints)})" if hints else "")
    )


def _call(fn: ScheduleFn, name: str, num_ranks, num_microbatches, num_chunks, options):
    params = inspect.signature(fn).parameters
    _check_options(name, params, options)  # first: a misspelt num_ranks is an unknown option
    if num_ranks is None or num_microbatches is None:
        raise ValueError(
            f"schedule {name!r} is a function: give the number of ranks and microbatches"
        )
    for what, value in (("ranks", num_ranks), ("microbatches", num_microbatches)):
        try:
            ok = operator.index(value) >= 1
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"the number of {what} must be a positive integer, got {value!r}")
    num_ranks, num_microbatches = operator.index(num_ranks), operator.index(num_microbatches)
    kwargs = dict(options)
    if num_chunks is not None:
        if "num_chunks" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
            kwargs["num_chunks"] = num_chunks
        elif num_chunks != 1:
            raise ValueError(f"schedule {name!r} takes no chunks per rank, got {num_chunks}")
    try:
        rows = fn(num_ranks, num_microbatches, **kwargs)
    except ValueError:
        raise  # the schedule's own sentence about what it cannot serve
    except Exception as e:
        raise ValueError(
            f"schedule {name!r} failed for {num_ranks} ranks and {num_microbatches} "
            f"microbatches: {type(e).__name__}: {e}"
        ) from e
    if isinstance(rows, Schedule):
        return dataclasses.replace(rows, name=rows.name or name)
    if rows is None or isinstance(rows, (str, bytes)) or not hasattr(rows, "__iter__"):
        raise ValueError(
            f"schedule {name!r} must return one list of actions per rank, got {type(rows).__name__}"
        )
    try:
        return Schedule.of(rows, name=name)
    except TypeError as e:
        raise ValueError(f"schedule {name!r} returned something that is not a schedule: {e}") from e


def get_schedule(
    spec: str | Schedule,
    num_ranks: int | None = None,
    num_microbatches: int | None = None,
    num_chunks: int | None = None,
    **options,
) -> Schedule:
    """Builds the schedule that `spec` names (see the module docstring).

    `num_chunks` (stages per rank) goes to the schedule function when given;
    `None` leaves the function's own default.

    For a CSV file the ranks and microbatches come from the file; if given they
    must agree with it.
    """
    if isinstance(spec, Schedule):
        return spec
    spec = str(spec)
    if spec.lower().endswith(".csv"):
        if options:
            raise ValueError(
                f"schedule file {spec!r} takes no options, got {', '.join(map(repr, options))}"
            )
        if not os.path.isfile(spec):
            raise ValueError(f"schedule file {spec!r} does not exist")
        schedule = Schedule.from_csv(spec)
        for what, given, actual in (
            ("ranks", num_ranks, schedule.num_ranks),
            ("microbatches", num_microbatches, schedule.num_microbatches),
        ):
            if given is not None and given != actual:
                raise ValueError(f"{spec} has {actual} {what}, but {given} were asked for")
        return schedule
    if ":" in spec and spec.split(":")[0].endswith(".py"):
        fn = _load_file_function(spec)
        return _call(fn, spec, num_ranks, num_microbatches, num_chunks, options)
    _load_builtins()
    entry = _REGISTRY.get(spec)
    if entry is None:
        known = ", ".join(sorted(_REGISTRY))
        raise ValueError(
            f"unknown schedule {spec!r}: use one of {known}, a .csv file, "
            "or path/to/file.py:function"
        )
    return _call(entry.fn, spec, num_ranks, num_microbatches, num_chunks, options)
