"""The README's promises: its two first commands, and its schedule example runs."""

import json
import re
from pathlib import Path

import pytest

import jpipe
from jpipe import show, testing

README = Path(__file__).resolve().parents[1] / "README.md"


def test_first_lines_are_the_two_commands():
    lines = README.read_text().splitlines()
    assert lines[0] == "```bash"
    assert lines[1].startswith("pip install -e . && python train.py")
    assert lines[2].startswith('pip install -e ".[test]" && pytest')
    ci = (README.parent / ".ci" / "run").read_text()
    assert 'pip install -e ".[test]" && pytest' in ci


@pytest.mark.slow
def test_the_schedule_example_runs(tmp_path, capsys):
    code = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    path = tmp_path / "my_schedule.py"
    path.write_text(code)
    spec = f"{path}:my_1f1b"
    assert show.main([spec, "--ranks", "4", "--microbatches", "8", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["makespan"] == 33 and figures["peak_activations"] == [4, 3, 2, 1]
    # The same figures as the built-in 1F1B, and it runs exactly.
    assert jpipe.get_schedule(spec, 4, 8).ranks == jpipe.get_schedule("1f1b", 4, 8).ranks
    assert testing.check_schedule(spec, 2, 3).passed


def test_train_py_uses_public_names_only():
    # The entry point is what users copy: no `jpipe._private` imports or attributes.
    import ast

    tree = ast.parse((README.parent / "train.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jpipe"):
            assert not any(p.startswith("_") for p in node.module.split(".")), node.module
            assert not any(a.name.startswith("_") for a in node.names), ast.dump(node)
        if isinstance(node, ast.Import):
            assert not any("._" in a.name for a in node.names if a.name.startswith("jpipe"))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in ("jpipe", "trainer"):
                assert not node.attr.startswith("_"), f"{node.value.id}.{node.attr}"


def _readme_loss_table(python: str) -> dict[int, str] | None:
    """The README's held-out losses for Python `python` ("3.11"), by step, as printed."""
    text = README.read_text()
    steps = re.search(r"^\| step \|(.*)\|$", text, re.M).group(1)
    row = re.search(rf"^\| Python {re.escape(python)} \(jax [^)]*\) \|(.*)\|$", text, re.M)
    if row is None:
        return None
    cells = zip(steps.split("|"), row.group(1).split("|"), strict=True)
    return {int(step): loss.strip() for step, loss in cells}


@pytest.mark.slow
def test_the_loss_table_is_what_train_py_prints(tmp_path):
    # `python train.py` exactly as the README runs it (the default config,
    # 300 steps, about 2 minutes on 2 cores), in a fresh process: every
    # held-out loss it prints must be the README's, digit for digit.
    import os
    import subprocess
    import sys

    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    table = _readme_loss_table(python)
    if table is None:
        pytest.skip(f"the README's loss table has no row for Python {python}")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # train.py fakes its own
    run = subprocess.run(
        [sys.executable, "train.py", f"--workdir={tmp_path / 'run'}"],
        cwd=README.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    printed = dict(re.findall(r"step (\d+): held-out loss (\d+\.\d+)", run.stdout + run.stderr))
    assert {int(step): loss for step, loss in printed.items()} == table
