"""README.md's configuration table, rendered from the fields of :class:`~tokenpipe.settings.Settings`.

Each setting is documented once, in its field's ``metadata``; this module only renders it.
``python -m tokenpipe.settings_doc`` prints the table, ``--write README.md`` replaces it in
place, and ``tests/test_settings_doc.py`` fails while README.md's copy differs.
The CLI's ``--help`` shows the same text (:func:`shown_default` included). (Not imported by the
package's ``__init__``, so that ``python -m`` runs it without a second import.)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from .settings import ENV_PREFIX, Settings

__all__ = ["TABLE_BEGIN", "TABLE_END", "REGENERATE", "render_table", "replace_table", "shown_default", "main"]

REGENERATE = "python -m tokenpipe.settings_doc --write README.md"
# README.md's table lies between these two lines; nothing else of the file is generated.
TABLE_BEGIN = f"<!-- settings table: generated from tokenpipe/settings.py by `{REGENERATE}` -->"
TABLE_END = "<!-- end of settings table -->"


def shown_default(f: dataclasses.Field[Any]) -> str:
    if "shown" in f.metadata:
        return str(f.metadata["shown"])
    value = f.default
    if value is dataclasses.MISSING:
        raise ValueError(f"Settings.{f.name} has a default_factory: give its metadata a 'shown' default")
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, str):
        return f"`{value}`" if value else "(empty)"
    return str(value)


def render_table() -> str:
    """README.md's configuration table: one row per field (variable, default, meaning), in field order."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(Settings):
        cells = (f"`{ENV_PREFIX}{f.name.upper()}`", shown_default(f), f.metadata["doc"])
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows) + "\n"


def replace_table(text: str) -> str:
    """``text`` (README.md) with the lines between the table markers replaced by :func:`render_table`."""
    head, begin, rest = text.partition(TABLE_BEGIN + "\n")
    _, end, tail = rest.partition(TABLE_END)
    if not begin or not end:
        raise ValueError(f"the settings table markers are missing: {TABLE_BEGIN!r} ... {TABLE_END!r}")
    return head + begin + render_table() + end + tail


def main(argv: list[str] | None = None) -> int:
    """Print the table, or with ``--write PATH`` replace it in PATH (README.md) in place."""
    parser = argparse.ArgumentParser(prog="python -m tokenpipe.settings_doc", description=main.__doc__)
    parser.add_argument("--write", metavar="PATH", help="replace the table between the markers in PATH")
    args = parser.parse_args(argv)
    if args.write is None:
        sys.stdout.write(render_table())
        return 0
    path = Path(args.write)
    path.write_text(replace_table(path.read_text(encoding="utf-8")), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
