"""Schedule specs: options, user files loaded more than once, and what `import jpipe` costs."""

import json
import subprocess
import sys
import textwrap

import pytest

import jpipe
from jpipe import check, show

# The README's own example: a schedule with an option, registered in a user's file.
MY_SCHEDULE = textwrap.dedent('''
    from jpipe import B, F, register_schedule


    @register_schedule("tests_my_1f1b")
    def my_1f1b(num_ranks, num_microbatches, warmup=None):
        """1F1B whose rank r runs `warmup - r` forwards before its first backward."""
        rows = []
        for r in range(num_ranks):
            ahead = min(num_microbatches, (warmup or num_ranks) - r - 1)
            row = [F(r, m) for m in range(ahead)]
            for m in range(num_microbatches):
                if ahead + m < num_microbatches:
                    row.append(F(r, ahead + m))
                row.append(B(r, m))
            rows.append(row)
        return rows
''')


@pytest.fixture(scope="module")
def my_file(tmp_path_factory):
    # One file for the module: two files registering one name is a clash.
    path = tmp_path_factory.mktemp("user") / "my_schedule.py"
    path.write_text(MY_SCHEDULE)
    return path


def _peaks(capsys, argv):
    assert show.main([*argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)["peak_activations"]


def test_options_from_the_spec_and_from_option_flags(capsys, my_file):
    spec = f"{my_file}:my_1f1b"
    sizes = ["-r", "4", "-m", "8"]
    assert _peaks(capsys, [spec, *sizes]) == [4, 3, 2, 1]
    deeper = [6, 5, 4, 3]  # warmup=6 keeps two more forwards in flight on every rank
    assert _peaks(capsys, [f"{spec}:warmup=6", *sizes]) == deeper
    assert _peaks(capsys, [spec, "--option", "warmup=6", *sizes]) == deeper
    assert _peaks(capsys, [spec, "-o", "warmup=6", *sizes]) == deeper
    schedule = jpipe.get_schedule(f"{spec}:warmup=6", 4, 8)
    assert schedule == jpipe.get_schedule(spec, 4, 8, warmup=6)


def test_unknown_and_malformed_options_are_refused_by_name(capsys, my_file):
    spec = f"{my_file}:my_1f1b"
    cases = [
        (["-o", "warmpu=6"], "takes no option 'warmpu'; its options: warmup"),
        (["-o", "warmup"], "'warmup' is not of the form key=value"),
        (["-o", "warmup=[1"], "'warmup=[1' is not of the form key=value"),
        (["-o", "warmup=x+1"], "'x+1' is not a Python literal"),
        (["-o", "warmup=1", "-o", "warmup=2"], "warmup= is given twice"),
    ]
    for extra, message in cases:
        assert show.main([spec, "-r", "4", "-m", "8", *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err, (extra, err)
        assert err.count("\n") == 1
    assert show.main([f"{spec}:warmup=1", "-r", "4", "-m", "8", "-o", "warmup=2"]) == 2
    assert "warmup= is given twice" in capsys.readouterr().err
    with pytest.raises(
        ValueError, match=r"schedule '1f1b' takes no option 'lag'; its options: none"
    ):
        jpipe.get_schedule("1f1b:lag=3", 4, 8)
    # check refuses the same, before it starts any devices
    assert check.main([spec, "-r", "4", "-m", "8", "-o", "warmpu=6"]) == 2
    assert "takes no option 'warmpu'; its options: warmup" in capsys.readouterr().err


_SEEN = {}


@jpipe.register_schedule("tests_records_options")
def _records_options(num_ranks, num_microbatches, **options):
    _SEEN.clear()
    _SEEN.update(options)
    return jpipe.get_schedule("gpipe", num_ranks, num_microbatches)


def test_option_values_are_python_literals(capsys):
    jpipe.get_schedule("tests_records_options:a=3,b=0.5, c='x:y'", 2, 2, d=(1, 2))
    assert _SEEN == {"a": 3, "b": 0.5, "c": "x:y", "d": (1, 2)}
    argv = ["tests_records_options:x=[1, 2]", "-r", "2", "-m", "2", "-o", "e=word", "-o", "n=None"]
    assert show.main([*argv, "--json"]) == 0
    assert _SEEN == {"x": [1, 2], "e": "word", "n": None}


def test_a_file_imported_first_loads_again_by_path(my_file):
    # As a user would: import the file as a module, then name it by path (a
    # subprocess, so the module name is free and the registry fresh).
    script = f"""
        import importlib, sys
        sys.path.insert(0, {str(my_file.parent)!r})
        import jpipe
        import my_schedule
        a = jpipe.get_schedule({str(my_file)!r} + ":my_1f1b", 4, 8)
        b = jpipe.get_schedule("tests_my_1f1b", 4, 8)
        importlib.reload(my_schedule)  # an edited file, reloaded
        c = jpipe.get_schedule({str(my_file)!r} + ":my_1f1b:warmup=5", 4, 8)
        assert a.ranks == b.ranks and c.num_ranks == 4
        try:
            @jpipe.register_schedule("tests_my_1f1b")
            def other(num_ranks, num_microbatches):
                return []
        except ValueError as e:
            print(e)
    """
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    message = result.stdout.strip()
    assert message.startswith("two different functions register a schedule named 'tests_my_1f1b'")
    assert f"my_schedule.my_1f1b ({my_file.resolve()}:5)" in message
    assert "__main__.other" in message and message.endswith("rename one of them")


def test_import_jpipe_is_cheap_and_reaches_the_subpackages():
    script = """
        import sys
        import jpipe
        from jpipe import B, F, register_schedule, simulate
        from jpipe.show import main
        assert main(["1f1b", "-r", "2", "-m", "2", "--json"]) == 0
        from jpipe.check import main as check
        assert check(["1f1b", "-r", "2", "-m", "2", "-o", "x=1"]) == 2
        assert "jax" not in sys.modules, "the schedule tools imported JAX"
        assert jpipe.testing.check_schedule and jpipe.models.GPTConfig and jpipe.train.train
        assert "jax" in sys.modules
        assert "make_mesh" in dir(jpipe) and "testing" in dir(jpipe)
        try:
            jpipe.no_such_name
        except AttributeError as e:
            print(e)
    """
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("module 'jpipe' has no attribute 'no_such_name'")
