"""The library's shape, as issue 36 set it: no import circle, no function over 150 lines, and
no lowering told apart by its name. Pure Python: an AST walk over jpipe/."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
LONGEST = 150


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted((ROOT / "jpipe").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(tree: ast.AST, modules: dict) -> set[str]:
    """The jpipe modules a module imports anywhere in it (function-local imports too)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in modules:
                found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names} & set(modules)
    return found


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on, groups, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in edges:
        if v not in index:
            visit(v)
    return groups


def _edges(modules) -> dict[str, set[str]]:
    # A package importing its own children (re-exports) is not a circle of ideas.
    def related(a, b):
        return a.startswith(b + ".") or b.startswith(a + ".")

    return {
        m: {t for t in _imports(ast.parse(p.read_text()), modules) if not related(m, t)}
        for m, p in modules.items()
    }


def test_no_import_circle():
    assert _cycles(_edges(_modules())) == []


def test_the_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_function_longer_than_150_lines():
    long = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})"
        for path in _modules().values()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > LONGEST
    ]
    assert not long, "split these functions:\n" + "\n".join(long)


def test_no_lowering_is_told_apart_by_its_name():
    """Compare a lowering by its traits (`jpipe.lower.interface.LoweringKind`), not its name."""
    found = []
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                names = [
                    c.value
                    for c in ast.walk(node)
                    if isinstance(c, ast.Constant) and c.value in ("spmd", "mpmd")
                ]
                if names:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "\n".join(found)
