"""``pip install tokenpipe`` without extras: the core, the producer SDK and the read-only CLI, no torch.

The package is built as a wheel from a copy of the sources (nothing written into the checkout,
no build isolation: the running environment's setuptools builds it) and installed into a fresh
virtualenv; its dependencies come from PyPI, through pip's cache after the first run. The
installed CLI then lists the streams of a real nats-server, and a role command names the extra
it needs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tokenpipe_cli.natsserver import NatsServer

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tokenpipe", "tokenpipe_cli", "producer", "generator", "relay")

pytestmark = pytest.mark.timeout(900)


def _run(*cmd: str | Path, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    built = _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp / "wheels",
                 src, cwd=tmp)
    assert built.returncode == 0, built.stdout + built.stderr
    wheel = next((tmp / "wheels").glob("tokenpipe-*.whl"))
    venv = tmp / "venv"
    made = _run(sys.executable, "-m", "venv", venv, cwd=tmp)
    assert made.returncode == 0, made.stderr
    installed = _run(venv / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check", wheel,
                     cwd=tmp)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return venv


def test_base_install_has_the_sdk_and_no_torch_transformers_or_web_server(base_venv: Path) -> None:
    probe = ("import importlib.util as u, producer, tokenpipe; from producer import Producer, RelayClient; "
             "print(sorted(m for m in ('torch', 'transformers', 'accelerate', 'fastapi', 'uvicorn') "
             "if u.find_spec(m)))")
    got = _run(base_venv / "bin" / "python", "-c", probe, cwd=base_venv)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "[]"


def test_the_wheel_ships_the_gemv_kernels_sources(base_venv: Path) -> None:
    """generator/kernels/build.py compiles its C sources (with their headers) and the C++ op bindings at
    start-up: an installed generator must have every one of them, where the build looks for them."""
    from generator.kernels.build import HEADERS, OP_SOURCES, OTHER_SOURCES, SOURCE

    probe = "import importlib.util as u, pathlib; print(pathlib.Path(u.find_spec('generator').origin).parent)"
    got = _run(base_venv / "bin" / "python", "-c", probe, cwd=base_venv)
    assert got.returncode == 0, got.stderr
    installed = Path(got.stdout.strip())
    for src in (SOURCE, *OTHER_SOURCES, *HEADERS, *OP_SOURCES):
        where = src.relative_to(ROOT / "generator")
        assert (installed / where).read_text() == src.read_text(), where


def test_base_install_runs_the_read_only_cli(base_venv: Path, tmp_path: Path) -> None:
    cli = base_venv / "bin" / "tokenpipe"
    for cmd in ("submit", "streams", "replay", "tail"):
        helped = _run(cli, cmd, "--help", cwd=tmp_path)
        assert helped.returncode == 0 and "--nats-url" in helped.stdout, helped.stderr
    with NatsServer(tmp_path / "nats") as server:
        listed = _run(cli, "streams", "--nats-url", server.url, "--data-dir", tmp_path, cwd=tmp_path, timeout=120)
    assert listed.returncode == 0, listed.stdout + listed.stderr


@pytest.mark.parametrize(("cmd", "extra"), [("relay", "relay"), ("generator", "generator"), ("up", "all")])
def test_a_role_command_without_its_extra_names_the_extra(base_venv: Path, tmp_path: Path, cmd: str,
                                                          extra: str) -> None:
    ran = _run(base_venv / "bin" / "tokenpipe", cmd, cwd=tmp_path, timeout=60)
    assert ran.returncode == 2, ran.stdout + ran.stderr
    assert f"pip install 'tokenpipe[{extra}]'" in ran.stderr
    assert "Traceback" not in ran.stderr
