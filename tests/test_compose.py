"""compose.yaml cross-checked against the code (no Docker engine runs here)."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import yaml

from tokenpipe.cli import build_parser
from tokenpipe.settings import ENV_PREFIX, Settings

ROOT = Path(__file__).resolve().parent.parent


def load() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_services_run_real_cli_commands_with_known_flags() -> None:
    parser = build_parser()
    services = load()["services"]
    for name in ("generator", "generator-gpu", "relay"):
        cmd = services[name]["command"]
        args = parser.parse_args(cmd)  # exits (fails the test) on an unknown subcommand or flag
        assert args.cmd in ("generator", "relay")


def test_environment_names_are_settings_fields() -> None:
    known = {ENV_PREFIX + f.name.upper() for f in fields(Settings)}
    for name, svc in load()["services"].items():
        for key in (svc.get("environment") or {}):
            if key.startswith(ENV_PREFIX):
                assert key in known, f"{name}: {key} is not a setting"


def test_relay_port_and_nats_url_agree() -> None:
    services = load()["services"]
    relay_cmd = services["relay"]["command"]
    port = relay_cmd[relay_cmd.index("--port") + 1]
    assert any(p.endswith(f":{port}:{port}") for p in services["relay"]["ports"])
    assert services["relay"]["environment"]["TOKENPIPE_NATS_URL"] == "nats://nats:4222"
    assert "-js" in services["nats"]["command"]
    assert services["generator-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
    assert (ROOT / ".env").read_text().strip() == "COMPOSE_PROFILES=cpu"


def test_dockerfile_copies_every_package() -> None:
    text = (ROOT / "Dockerfile").read_text()
    for pkg in ("tokenpipe", "producer", "generator", "relay"):
        assert f"COPY {pkg} ./{pkg}" in text
