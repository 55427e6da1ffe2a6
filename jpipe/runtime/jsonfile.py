"""A user's JSON file, read in one place: its value, or one line saying what is wrong.

Plan files, profiles and Sailor's files all come from a user's disk, and
each can be missing, unreadable, cut short or not text at all. `read_json`
turns each of those into a `ValueError` of one line that names the kind of
file expected (``"plan file"``, ``"profile"``), the file, and, where the
text stops being JSON, the line and column::

    cannot read plan file 'p.json': No such file or directory
    plan file 'p.json' is not JSON: Expecting ',' delimiter: line 3 column 5 (char 27)
    profile 'q.json' is not JSON: not UTF-8 text at line 2 column 7 (byte 0xff)

The bytes are decoded as `json.loads` decodes them: UTF-8 (a leading byte
order mark skipped), or UTF-16/32 where the first bytes say so. What the
value must hold (an object, a format, its fields) is the caller's to check,
in the caller's words. Nothing here imports JAX.
"""

from __future__ import annotations

import json


def read_json(path: str, kind: str):
    """The JSON value in the file at `path`, a `kind` of file; else a `ValueError` of one line."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except OSError as e:
        raise ValueError(f"cannot read {kind} {path!r}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{kind} {path!r} is not JSON: {e}") from None
    except UnicodeDecodeError as e:
        before = e.object[: e.start].decode(e.encoding, "replace").removeprefix("\ufeff")
        line, column = before.count("\n") + 1, len(before) - before.rfind("\n")
        raise ValueError(
            f"{kind} {path!r} is not JSON: not {e.encoding.upper()} text at line {line} "
            f"column {column} (byte {e.object[e.start]:#04x})"
        ) from None
