"""README.md's configuration table is generated from the Settings fields and must not drift."""

from __future__ import annotations

import dataclasses
import difflib
import subprocess
import sys
from pathlib import Path

import pytest

from tokenpipe.settings import Settings
from tokenpipe.settings_doc import REGENERATE, TABLE_BEGIN, TABLE_END, render_table, replace_table

README = Path(__file__).resolve().parent.parent / "README.md"


def test_every_setting_is_documented() -> None:
    undocumented = [f.name for f in dataclasses.fields(Settings) if not str(f.metadata.get("doc", "")).strip()]
    assert not undocumented, f"give these Settings fields a metadata['doc']: {undocumented}"


def test_readme_configuration_table_matches_settings() -> None:
    text = README.read_text(encoding="utf-8")
    assert TABLE_BEGIN in text and TABLE_END in text, f"README.md lost its settings table markers; run `{REGENERATE}`"
    fresh = replace_table(text)
    diff = "".join(difflib.unified_diff(text.splitlines(True), fresh.splitlines(True), "README.md", "generated"))
    assert fresh == text, f"README.md's configuration table is stale; run `{REGENERATE}`\n{diff}"


def test_table_has_one_row_per_setting() -> None:
    rows = render_table().splitlines()[2:]
    assert [row.split("`")[1] for row in rows] == [f"TOKENPIPE_{f.name.upper()}" for f in dataclasses.fields(Settings)]


def test_replace_table_needs_the_markers() -> None:
    with pytest.raises(ValueError, match="markers"):
        replace_table("# no table here\n")


def test_module_prints_the_table() -> None:
    out = subprocess.run([sys.executable, "-m", "tokenpipe.settings_doc"], capture_output=True, text=True, check=True)
    assert out.stdout == render_table()
    assert out.stderr == ""
