"""The README's promises: its two first commands, and its schedule example runs."""

import json
import re
from pathlib import Path

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
