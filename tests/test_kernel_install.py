"""The native library built ahead of the first start (generator/kernels/install.py, build.py, levels.py): one
object per x86 level from `tokenpipe build-kernels`, one build at a time per directory (two processes), start-up
loading a prebuilt object without a compiler, and the Docker image copying what its build stage builds (the
Dockerfile parsed: no Docker engine runs here)."""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pytest

from generator.kernels.build import load_gemv, prebuilt_dir, unsupported
from generator.kernels.cpu import cpu_info
from generator.kernels.install import build_kernels
from generator.kernels.levels import LEVELS, level_for
from tokenpipe_cli.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent

# a process that loads the library the way a generator starts: its log on stderr, what it loaded on stdout
_LOAD = """
import json, logging, sys
from pathlib import Path
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")
from generator.kernels.build import load_gemv
lib = load_gemv(sys.argv[1], prebuilt=Path(sys.argv[2]))
print(json.dumps({"path": str(lib.path) if lib else None, "lanes": lib.lanes() if lib else None}))
"""
_LANES = "import sys, torch; torch.ops.load_library(sys.argv[1]); print(int(torch.ops.tokenpipe.gemm8_lanes()))"


def _python(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **(env or {})})


@dataclass
class Builds:
    """Two generators' starts at once on one fresh data dir without prebuilt objects, then `tokenpipe
    build-kernels` into the same directory: what each printed."""

    kernels: Path
    starts: list[tuple[int, str, str]]
    command: tuple[int, str, str]


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> Builds:
    if unsupported():
        pytest.skip(f"the library does not run here: {unsupported()}")
    data, empty = tmp_path_factory.mktemp("data"), tmp_path_factory.mktemp("no-prebuilt")
    procs = [_python("-c", _LOAD, str(data), str(empty)) for _ in range(2)]
    starts = [(p.wait(timeout=900), *p.communicate(timeout=60)) for p in procs]
    cmd = _python("-m", "tokenpipe_cli", "build-kernels", "--out", str(data / "kernels"))
    out, err = cmd.communicate(timeout=900)
    return Builds(data / "kernels", starts, (cmd.returncode, out, err))


def test_two_generators_starting_at_once_compile_the_library_once(builds: Builds) -> None:
    """Regression (issue 49): both generators of `tokenpipe up --generators 2` compiled the same library side
    by side (46 s). The build's lock makes the second wait, then load the first's object."""
    for rc, _out, err in builds.starts:
        assert rc == 0, err[-3000:]
    loaded = [json.loads(out) for _, out, _ in builds.starts]
    compiled = ["compiling the native kernels" in err for _, _, err in builds.starts]
    assert sorted(compiled) == [False, True], [err[-2000:] for _, _, err in builds.starts]
    info = cpu_info()
    level = level_for(info[1] if info else None)
    assert loaded[0]["path"] == loaded[1]["path"]
    assert Path(loaded[0]["path"]).parent == builds.kernels and f"-{level.name}-" in loaded[0]["path"]


def test_build_kernels_writes_one_object_per_level_and_skips_what_is_up_to_date(builds: Builds) -> None:
    """Every level is built, those this CPU cannot run too; the level the starts built is up to date (same
    sources, flags, compiler and torch): the command says which, one line per level."""
    rc, out, err = builds.command
    assert rc == 0, err[-3000:]
    rows = [line.split("\t") for line in out.splitlines()]
    assert [r[0] for r in rows] == [lvl.name for lvl in LEVELS]
    info = cpu_info()
    mine = level_for(info[1] if info else None).name
    assert {r[0]: r[1] for r in rows} == {lvl.name: "up to date" if lvl.name == mine else "built" for lvl in LEVELS}
    objects = sorted(builds.kernels.glob("*.so"))
    assert len(objects) == len(LEVELS) and sorted(Path(r[2]) for r in rows) == objects
    assert "[1/3]" in err and "kernels built in" in err  # progress, for the three compiled here


def test_each_level_this_cpu_runs_loads_with_its_vector_width(builds: Builds) -> None:
    """Loading checks only the runnable levels: gemm8's blocks are 16 features with VNNI, else 8."""
    info = cpu_info()
    runnable = [lvl for lvl in LEVELS if info is not None and lvl.runs_on(info[1])]
    assert runnable, "every x86 CPU these tests run on has AVX2"
    for lvl in runnable:
        (obj,) = builds.kernels.glob(f"tokenpipe-{lvl.name}-*.so")
        proc = _python("-c", _LANES, str(obj))
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        assert int(out) == (16 if "avx512_vnni" in lvl.needs else 8), lvl.name


def test_a_start_with_prebuilt_objects_loads_them_without_a_compiler(builds: Builds, tmp_path: Path) -> None:
    """As in the image: no compiler on PATH, a fresh data dir, the objects built ahead: loaded, nothing compiled."""
    proc = _python("-c", _LOAD, str(tmp_path), str(builds.kernels), env={"CC": "no-such-cc", "CXX": "no-such-cxx"})
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    loaded = json.loads(out)
    assert loaded["path"] is not None and Path(loaded["path"]).parent == builds.kernels
    assert "compiling" not in err and not (tmp_path / "kernels").exists()


def test_no_compiler_and_no_prebuilt_object_is_one_log_line_and_torchs_kernels(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CC", "no-such-cc")
    with caplog.at_level(logging.INFO, logger="generator.kernels.build"):
        assert load_gemv(tmp_path, prebuilt=tmp_path / "none") is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "no C and C++ compilers (no-such-cc" in lines[0] and "torch's kernels" in lines[0]


def test_build_kernels_without_a_compiler_says_so_and_fails_only_when_strict(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`make install` goes on without a compiler (torch's kernels serve); the image's build must not."""
    monkeypatch.setenv("CXX", "no-such-cxx")
    assert build_kernels(tmp_path, ()) == 0
    assert "nothing built: no C and C++ compilers" in capsys.readouterr().err
    assert build_kernels(tmp_path, (), strict=True) == 1
    assert not list(tmp_path.iterdir())


def test_the_cli_offers_the_levels_the_build_has() -> None:
    kern = build_parser().parse_args(["build-kernels", "--level", "avx2", "--level", "amx", "--strict"])
    assert kern.level == ["avx2", "amx"] and kern.strict
    for lvl in LEVELS:
        assert build_parser().parse_args(["build-kernels", "--level", lvl.name]).level == [lvl.name]


def _stages(dockerfile: str) -> dict[str, list[tuple[str, str]]]:
    """The Dockerfile's stages by name: their instructions as (KEYWORD, rest), continuations joined."""
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    logical = ""
    for line in dockerfile.splitlines():
        if line.lstrip().startswith("#") and not logical:
            continue
        logical += line.rstrip("\\").strip() + " "
        if line.endswith("\\"):
            continue
        keyword, _, rest = logical.strip().partition(" ")
        logical = ""
        if keyword.upper() == "FROM":
            current = stages.setdefault(rest.split()[-1], [])
        elif keyword:
            current.append((keyword.upper(), rest.strip()))
    return stages


def test_the_image_copies_what_its_build_stage_builds_where_the_generator_looks() -> None:
    """Regression (issue 49): the image had no compiler, so the library was never built and torch's kernels
    served. The build stage installs gcc/g++, runs `tokenpipe build-kernels --strict` after installing the
    generator, and the runtime stage copies its output to where start-up looks (the venv's prebuilt dir)."""
    stages = _stages((ROOT / "Dockerfile").read_text())
    build, runtime = stages["build"], stages["runtime"]
    runs = [rest for kw, rest in build if kw == "RUN"]
    at = next(i for i, r in enumerate(runs) if "tokenpipe build-kernels" in r)
    assert any("apt-get install" in r and " gcc " in f"{r} " and " g++ " in f"{r} " for r in runs[:at])
    assert any('pip install ".[all]"' in r for r in runs[:at])
    words = shlex.split(runs[at])
    args = build_parser().parse_args(words[words.index("tokenpipe") + 1:])
    assert args.cmd == "build-kernels" and args.strict and not args.level  # every level
    out = PurePosixPath(args.out)
    venv = PurePosixPath("/opt/venv")
    assert ("ENV", "PATH=/opt/venv/bin:$PATH") in build  # the venv's python runs the command
    # where a generator in the runtime looks: the venv's prebuilt dir
    assert out == venv / PurePosixPath(*prebuilt_dir().relative_to(sys.prefix).parts)
    copies = [rest.split() for kw, rest in runtime if kw == "COPY" and rest.startswith("--from=build")]
    assert any(out.is_relative_to(src) and PurePosixPath(dst) == PurePosixPath(src) for _, src, dst in copies)
    envs = " ".join(rest for kw, rest in runtime if kw == "ENV")
    assert "PATH=/opt/venv/bin:" in envs  # the runtime runs that venv's python (sys.prefix /opt/venv)
    assert not any("gcc" in rest for kw, rest in runtime if kw == "RUN")  # no compiler in the runtime
