"""A small renderer for the subset of Helm's Go templates that deploy/helm/tokenpipe uses.

No ``helm`` binary can be installed from the registries this project builds from (PyPI, npm),
so the chart's tests render it here. Supported: ``{{ .Values.a.b }}``, ``.Release.Name``,
``.Release.Namespace``, ``.Chart.*``; ``if``/``else``/``end`` (Go truthiness);
``range $var := until N``/``end`` (``$var`` counts 0 to N-1; inside, the root is ``$.``, as in Helm,
where ``.`` is the element); pipelines with
``quote``, ``toYaml``, ``nindent``, ``indent``, ``default``, ``not``, ``and``, ``or``, ``eq``, ``int``;
``{{-``/``-}}`` whitespace trimming. Anything else raises, so the chart stays within what this
renderer (and therefore the test) understands. A real ``helm template`` renders the same text.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

_ACTION = re.compile(r"{{(-?)\s*(.*?)\s*(-?)}}", re.S)


def _truthy(v: Any) -> bool:
    return v not in (None, False, 0, "", [], {})


def _to_yaml(v: Any) -> str:
    return yaml.safe_dump(v, default_flow_style=False, sort_keys=True).rstrip("\n") if _truthy(v) else (
        "{}" if isinstance(v, dict) or v is None else "[]" if isinstance(v, list) else str(v))


def _indent(n: int, s: str) -> str:
    return "\n".join(" " * int(n) + line for line in str(s).split("\n"))


_FUNCS: dict[str, Callable[..., Any]] = {
    "quote": lambda v: '"' + str("" if v is None else v).replace("\\", "\\\\").replace('"', '\\"') + '"',
    "toYaml": _to_yaml,
    "indent": _indent,
    "nindent": lambda n, s: "\n" + _indent(n, s),
    "default": lambda d, v=None: v if _truthy(v) else d,
    "not": lambda v: not _truthy(v),
    "and": lambda *a: all(_truthy(x) for x in a),
    "or": lambda *a: next((x for x in a if _truthy(x)), a[-1]),
    "eq": lambda a, b: a == b,
    "int": int,
    "until": lambda n: list(range(int(n))),
}
_RANGE = re.compile(r"range (\$\w+) := (.+)")
_TOKEN = re.compile(r'\([^()]*\)|"(?:[^"\\]|\\.)*"|\S+')  # a (sub-pipeline), a "string", a word


class Renderer:
    def __init__(self, context: dict[str, Any]) -> None:
        self.context = context
        self.variables: dict[str, Any] = {}

    def _term(self, tok: str) -> Any:
        if tok.startswith("(") and tok.endswith(")"):
            return self.eval(tok[1:-1])
        if tok.startswith("$."):  # the root context, the one way to reach it inside a range
            return self._lookup(tok[1:])
        if tok.startswith("$"):
            if tok not in self.variables:
                raise ValueError(f"undefined template variable {tok}")
            return self.variables[tok]
        if tok.startswith("."):
            if self.variables:  # Helm binds "." to the element inside a range: .Values there is an error
                raise ValueError(f"{tok} inside a range: write ${tok}")
            return self._lookup(tok)
        if tok.startswith('"'):
            return shlex.split(tok)[0]
        if tok in ("true", "false"):
            return tok == "true"
        if re.fullmatch(r"-?\d+", tok):
            return int(tok)
        raise ValueError(f"unsupported template term {tok!r}")

    def _lookup(self, path: str) -> Any:
        v: Any = self.context
        for part in path[1:].split("."):
            v = v.get(part) if isinstance(v, dict) else None
        return v

    def eval(self, expr: str) -> Any:
        value: Any = _NOTHING
        for stage in expr.split("|"):
            toks = _TOKEN.findall(stage.strip())
            if toks[0] in _FUNCS:
                args = [self._term(t) for t in toks[1:]]
                if value is not _NOTHING:
                    args.append(value)
                value = _FUNCS[toks[0]](*args)
            elif len(toks) == 1 and value is _NOTHING:
                value = self._term(toks[0])
            else:
                raise ValueError(f"unsupported template pipeline {expr!r}")
        return value

    def render(self, text: str) -> str:
        # Tokenize into text and actions, applying the trim markers.
        parts: list[tuple[str, str]] = []
        pos = 0
        for m in _ACTION.finditer(text):
            chunk = text[pos:m.start()]
            if m.group(1):
                chunk = chunk.rstrip()
            parts.append(("text", chunk))
            parts.append(("action", m.group(2)))
            pos = m.end()
            if m.group(3):
                rest = text[pos:]
                pos += len(rest) - len(rest.lstrip())
        parts.append(("text", text[pos:]))
        out, _ = self._block(parts, 0)
        return out

    def _block(self, parts: list[tuple[str, str]], i: int) -> tuple[str, int]:
        """Render from ``i`` until an ``else``/``end`` at this level; (text, index of that token)."""
        out: list[str] = []
        while i < len(parts):
            kind, body = parts[i]
            if kind == "text":
                out.append(body)
                i += 1
                continue
            if body.startswith("/*"):
                i += 1
                continue
            if body in ("else", "end"):
                return "".join(out), i
            loop = _RANGE.fullmatch(body)
            if loop:
                items = self.eval(loop[2])
                for item in items or [None]:  # an empty range walks its body once, unseen, to find its end
                    self.variables[loop[1]] = item
                    text, j = self._block(parts, i + 1)
                    if items:
                        out.append(text)
                self.variables.pop(loop[1], None)
                if parts[j][1] != "end":
                    raise ValueError("range without end")
                i = j + 1
                continue
            if body.startswith("if "):
                then, j = self._block(parts, i + 1)
                other = ""
                if parts[j][1] == "else":
                    other, j = self._block(parts, j + 1)
                if parts[j][1] != "end":
                    raise ValueError("if without end")
                out.append(then if _truthy(self.eval(body[3:])) else other)
                i = j + 1
                continue
            value = self.eval(body)
            out.append("" if value is None else str(value).lower() if isinstance(value, bool) else str(value))
            i += 1
        return "".join(out), i


_NOTHING = object()


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def render_chart(chart: Path, overrides: dict[str, Any] | None = None, *, release: str = "tp",
                 namespace: str = "default") -> dict[str, str]:
    """Every template of ``chart`` rendered (NOTES.txt and partials left out), by file name."""
    values = _merge(yaml.safe_load((chart / "values.yaml").read_text()), overrides or {})
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    r = Renderer({"Values": values, "Release": {"Name": release, "Namespace": namespace},
                  "Chart": {"Name": meta["name"], "Version": meta["version"], "AppVersion": meta["appVersion"]}})
    return {p.name: r.render(p.read_text()) for p in sorted((chart / "templates").iterdir())
            if p.suffix in (".yaml", ".yml") and not p.name.startswith("_")}
