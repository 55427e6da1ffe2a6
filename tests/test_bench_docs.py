"""bench.docs: a bench command rewrites its own block of a docs page, and nothing else."""

import re
import sys

import pytest

from bench import docs

PAGE = """# A page

Prose before.

<!-- bench:table -->
| a | b |
|---|---|
| 1 | 2 |

`python -m bench.old` · 2026-01-01 · jax 0.1 / jaxlib 0.1 · x86_64, 2 cores
<!-- /bench:table -->

Prose after, with a <!-- bench:other --> mention of another block.
<!-- /bench:other -->
"""


def test_a_block_is_replaced_and_the_rest_is_untouched():
    new = docs.replace_block(PAGE, "table", "| a |\n|---|\n| 3 |")
    before, rest = PAGE.split("<!-- bench:table -->")
    _, after = rest.split("<!-- /bench:table -->")
    assert new.startswith(before + "<!-- bench:table -->\n| a |\n|---|\n| 3 |\n")
    assert new.endswith("<!-- /bench:table -->" + after)
    assert "| 1 | 2 |" not in new and "2026-01-01" not in new
    # Replacing again with the same body changes nothing.
    assert docs.replace_block(new, "table", "| a |\n|---|\n| 3 |") == new


def test_block_carries_the_command_date_and_versions():
    command = "python -m bench.x --write-docs"
    body = docs.block("| x |\n|---|\n| 1 |\n", command, "2026-12-07")
    assert body.startswith(f"| x |\n|---|\n| 1 |\n\n`{command}` · 2026-12-07 · ")
    assert re.search(r"· (jax \S+ / jaxlib \S+|no jax) · ", body)


def test_write_rewrites_the_file(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    docs.write(str(page), "other", "new other", "python -m bench.y", "2026-12-07")
    text = page.read_text()
    assert "<!-- bench:other -->\nnew other\n\n`python -m bench.y` · 2026-12-07" in text
    assert text.split("<!-- bench:other -->")[0] == PAGE.split("<!-- bench:other -->")[0]


def test_a_missing_block_is_refused():
    with pytest.raises(docs.MarkerError, match=r"docs/x.md has no block 'nothing'"):
        docs.replace_block(PAGE, "nothing", "x", "docs/x.md")


def test_a_doubled_or_half_marker_is_refused():
    doubled = PAGE + "\n<!-- bench:table -->\n<!-- /bench:table -->\n"
    with pytest.raises(docs.MarkerError, match=r"2 '<!-- bench:table -->' and 2"):
        docs.replace_block(doubled, "table", "x")
    half = PAGE.replace("<!-- /bench:table -->", "")
    with pytest.raises(docs.MarkerError, match=r"needs exactly one of each"):
        docs.replace_block(half, "table", "x")
    swapped = "<!-- /bench:t -->\n<!-- bench:t -->\n"
    with pytest.raises(docs.MarkerError, match=r"comes before"):
        docs.replace_block(swapped, "t", "x")


def test_a_bad_name_is_refused():
    with pytest.raises(ValueError, match="lower-case"):
        docs.markers("Bad Name")


def test_the_pages_blocks_are_well_formed():
    """Every block of the measurement pages has exactly one pair of markers."""
    for page in (
        "docs/benchmarks.md",
        "docs/compiler-measurements.md",
        "docs/planner-validation.md",
        "docs/scale.md",
    ):
        with open(page, encoding="utf-8") as f:
            text = f.read()
        names = docs.blocks(text)
        assert names, page
        assert len(names) == len(set(names)), page
        for name in names:
            assert docs.replace_block(text, name, "x", page).count("<!-- /bench:") == len(names)


def test_a_command_output_becomes_the_block(tmp_path, capsys):
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    command = [sys.executable, "-c", "print('| new |')"]
    docs.main([str(page), "table", "--", *command])
    text = page.read_text()
    assert "<!-- bench:table -->\n| new |\n\n`python -m bench.docs " in text
    assert "| 1 | 2 |" not in text
    # A command that fails leaves the page as it was; a missing block is refused first.
    with pytest.raises(SystemExit, match="exited 3"):
        docs.main([str(page), "table", "--", sys.executable, "-c", "raise SystemExit(3)"])
    assert page.read_text() == text
    with pytest.raises(docs.MarkerError):
        docs.main([str(page), "absent", "--", *command])
