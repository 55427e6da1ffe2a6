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

Options for the schedule function (its keyword arguments, such as ZB-H1's
``lag``) follow a last colon, as Python keyword arguments whose values are
literals: ``zb_h1:lag=3``, ``my.py:my_1f1b:warmup=6``, ``x:a=1,b=(2, 3)``. A
bare word is a string (``mode=fast``). The command lines also take them one
at a time, ``--option lag=3`` (`parse_options`).

A ``file.py:function`` SPEC runs that file's code (`names_code`): the
trainer refuses one that comes from a plan file unless told the plan is
trusted (docs/trust.md). Sizes past `jpipe.schedule.actions.MAX_RANKS` ranks or
`MAX_ACTIONS` actions are refused before the function runs (`check_size`).
"""

from __future__ import annotations

import ast
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

from jpipe.schedule.actions import MAX_ACTIONS, MAX_RANKS, Schedule, check_size

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
        # The same function of the same file registering again is no clash: the
        # file was imported under another module name (``import my_schedule``,
        # then ``my_schedule.py:fn``), or reloaded after an edit.
        if existing is not None and _origin(existing.fn) != _origin(fn):
            raise ValueError(
                f"two different functions register a schedule named {name!r}: "
                f"{_describe(existing.fn)} and {_describe(fn)}; rename one of them"
            )
        _REGISTRY[name] = _Entry(fn, inspect.getdoc(fn) or "")
        return fn

    return decorate


def _origin(fn: ScheduleFn) -> tuple[str, str]:
    """Where `fn` is written: its file (or module, where it has no file) and qualified name."""
    code = getattr(fn, "__code__", None)
    where = os.path.realpath(code.co_filename) if code is not None else fn.__module__
    return where, getattr(fn, "__qualname__", repr(fn))


def _describe(fn: ScheduleFn) -> str:
    code = getattr(fn, "__code__", None)
    name = f"{fn.__module__}.{getattr(fn, '__qualname__', repr(fn))}"
    return f"{name} ({code.co_filename}:{code.co_firstlineno})" if code is not None else name


def add_option_argument(parser) -> None:
    """The ``-o/--option KEY=VALUE`` flag of the command-line tools (read by `parse_options`)."""
    parser.add_argument(
        "-o",
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of the schedule function, a Python literal (lag=3); repeatable",
    )


def parse_options(items) -> dict[str, Any]:
    """Reads schedule options from ``"key=value"`` texts; values are Python literals.

    Each text may hold several, separated by commas as in a call
    (``"lag=3, warmup=(1, 2)"``); a bare word is a string. `ValueError`
    names a text that is not of this form.
    """
    options: dict[str, Any] = {}
    for text in [items] if isinstance(items, str) else items:
        try:
            call = ast.parse(f"f({text})", mode="eval").body
        except SyntaxError:
            call = None
        if not isinstance(call, ast.Call) or call.args or not call.keywords:
            raise ValueError(
                f"schedule option {text!r} is not of the form key=value (a Python literal, "
                "such as lag=3, scale=0.5, order='zigzag' or sizes=(2, 3))"
            )
        for kw in call.keywords:
            if kw.arg is None:
                raise ValueError(f"schedule option {text!r}: ** is not an option")
            if isinstance(kw.value, ast.Name):
                value = kw.value.id  # a bare word: the string
            else:
                try:
                    value = ast.literal_eval(kw.value)
                except ValueError:
                    raise ValueError(
                        f"schedule option {kw.arg}= in {text!r}: "
                        f"{ast.get_source_segment(f'f({text})', kw.value)!r} is not a "
                        "Python literal (a number, string, tuple, list, dict, True, False "
                        "or None)"
                    ) from None
            if kw.arg in options:
                raise ValueError(f"schedule option {kw.arg}= is given twice")
            options[kw.arg] = value
    return options


def split_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """Splits ``"zb_h1:lag=3"`` into the schedule ``"zb_h1"`` and its options ``{"lag": 3}``."""
    colons = [i for i, c in enumerate(spec) if c == ":" and i > 0]
    for i in colons:  # the first colon after which come options (a value may hold one)
        if "=" in spec[i + 1 :]:
            try:
                return spec[:i], parse_options(spec[i + 1 :])
            except ValueError:
                continue
    if colons and "=" in spec[colons[-1] + 1 :]:
        parse_options(spec[colons[-1] + 1 :])  # raises, naming what is wrong
    return spec, {}


def names_code(spec) -> bool:
    """Whether a schedule SPEC is ``path/to/file.py:function``, whose file would be run."""
    # The rule `get_schedule` follows: options only ever follow the function's name.
    return isinstance(spec, str) and ":" in spec and spec.split(":")[0].endswith(".py")


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
    chunks = num_chunks if isinstance(num_chunks, int) and not isinstance(num_chunks, bool) else 1
    check_size(num_ranks, num_microbatches, chunks, f"schedule {name!r}")
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
        schedule = dataclasses.replace(rows, name=rows.name or name)
        _check_built(schedule, name)
        return schedule
    if rows is None or isinstance(rows, (str, bytes)) or not hasattr(rows, "__iter__"):
        raise ValueError(
            f"schedule {name!r} must return one list of actions per rank, got {type(rows).__name__}"
        )
    try:
        schedule = Schedule.of(rows, name=name)
    except TypeError as e:
        raise ValueError(f"schedule {name!r} returned something that is not a schedule: {e}") from e
    _check_built(schedule, name)
    return schedule


def _check_built(schedule: Schedule, name: str) -> None:
    """A function's schedule is held to the limits its arguments were (it may add actions)."""
    actions = sum(len(row) for row in schedule.ranks)
    if schedule.num_ranks > MAX_RANKS or actions > MAX_ACTIONS:
        raise ValueError(
            f"schedule {name!r} returned {schedule.num_ranks} ranks and {actions:,} actions, "
            f"past jpipe's limits MAX_RANKS={MAX_RANKS}, MAX_ACTIONS={MAX_ACTIONS:,} "
            "(jpipe.schedule.actions)"
        )


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

    `spec` may end in options (``"zb_h1:lag=3"``, see the module docstring);
    they and `options` go to the schedule function as keyword arguments, and
    one it does not take is refused with the list of those it does.

    For a CSV file the ranks and microbatches come from the file; if given they
    must agree with it.
    """
    if isinstance(spec, Schedule):
        return spec
    spec, spec_options = split_spec(str(spec))
    for key in spec_options.keys() & options.keys():
        raise ValueError(f"schedule option {key}= is given twice (in the spec and as an option)")
    options = {**spec_options, **options}
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
            ("microbatches", num_microbatches, schedule.num_sequences),
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
