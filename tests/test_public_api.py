"""jpipe's public API: one list of the user's words, importable without JAX, and no private
module imported from outside the library."""

import ast
import importlib
import pathlib
import subprocess
import sys

import jpipe

ROOT = pathlib.Path(__file__).resolve().parent.parent
INIT = ROOT / "jpipe" / "__init__.py"


def _type_checking_imports() -> dict[str, str]:
    """The names the TYPE_CHECKING block of jpipe/__init__.py imports, with their modules."""
    tree = ast.parse(INIT.read_text())
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
    )
    names = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and len(node.names) == 1, ast.dump(node)
        alias = node.names[0]
        assert alias.asname == alias.name, f"{alias.name} is renamed on the way out"
        assert alias.name not in names, f"{alias.name} imported twice"
        names[alias.name] = node.module
    return names


def test_the_static_list_is_the_lazy_one():
    assert _type_checking_imports() == jpipe._EXPORTS
    assert jpipe.__all__ == sorted(jpipe._EXPORTS)


def test_every_name_is_its_modules_own_under_the_same_name():
    for name, module in jpipe._EXPORTS.items():
        value = getattr(jpipe, name)
        assert value is getattr(importlib.import_module(module), name)
        if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__"):
            assert value.__name__ == name, f"jpipe.{name} is {value.__name__} renamed"


def test_the_compilers_internals_are_not_user_words():
    for internal in ("pack_lifetimes", "TICK_LAYOUTS", "Transfers", "stage_pieces", "plan_cluster"):
        assert internal not in jpipe.__all__
        assert not hasattr(jpipe, internal)


def test_import_jpipe_and_the_schedule_language_need_no_jax():
    code = (
        "import sys, jpipe\n"
        "s = jpipe.get_schedule('1f1b', num_ranks=2, num_microbatches=4)\n"
        "jpipe.simulate(jpipe.validate(s))\n"
        "assert 'jax' not in sys.modules, 'jax was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def _shown(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _private(module: str) -> bool:
    """Whether a dotted ``jpipe`` name passes through a part that starts with one underscore."""
    parts = module.split(".")
    return parts[0] == "jpipe" and any(
        p.startswith("_") and not p.startswith("__") for p in parts[1:]
    )


def _is_package(module: str) -> bool:
    return (ROOT.joinpath(*module.split(".")) / "__init__.py").exists()


def _private_imports(path: pathlib.Path) -> list[str]:
    """Every private ``jpipe`` module (or a package's private name) the file imports or names."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        modules = []
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module]
            if _is_package(node.module):  # `from jpipe import _x` imports a private module
                modules += [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # monkeypatch targets and import_module("...") strings
            if node.value.startswith("jpipe.") and " " not in node.value:
                modules = [node.value]
        found += [f"{_shown(path)}:{node.lineno}: {m}" for m in modules if _private(m)]
    return found


def test_nothing_outside_the_library_imports_its_private_modules():
    files = [ROOT / "train.py"]
    for folder in ("tests", "bench", "examples", "configs", "schedules"):
        files += sorted((ROOT / folder).rglob("*.py"))
    found = [hit for f in files for hit in _private_imports(f)]
    assert not found, "private jpipe modules imported from outside jpipe/:\n" + "\n".join(found)


def test_the_private_import_check_can_fail(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import jpipe._ticks\n"
        "from jpipe.planner._search import plan\n"
        "from jpipe import _lower\n"
        "target = 'jpipe._pipeline.Pipeline'\n"
        "from jpipe.lower.spmd import ticks\n"  # public rooms are fine
    )
    assert len(_private_imports(probe)) == 4, _private_imports(probe)
