"""compose.yaml and deploy/ cross-checked against the code (no Docker engine runs here)."""

from __future__ import annotations

import json
import re
from dataclasses import fields
from pathlib import Path

import yaml

from tokenpipe.cluster import server_list
from tokenpipe.metrics import GeneratorMetrics, RelayMetrics
from tokenpipe.settings import ENV_PREFIX, Settings
from tokenpipe_cli.cli import build_parser
from tokenpipe_cli.clusternode import node_args

ROOT = Path(__file__).resolve().parent.parent
OTEL_VARS = {"OTEL_SERVICE_NAME", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_ENDPOINT"}


def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def services() -> dict:
    return compose()["services"]


def test_services_run_real_cli_commands_with_known_flags() -> None:
    parser = build_parser()
    for name in ("generator", "generator-gpu", "relay", "nats"):
        args = parser.parse_args(services()[name]["command"])  # exits (fails) on an unknown flag
        assert args.cmd in ("generator", "relay", "nats")


def test_the_bus_is_locked_down_and_each_role_brings_its_own_credentials() -> None:
    """Regression: compose ran nats-server with no authorization (any container could read every
    tenant's tokens); now it runs tokenpipe's own, with one user per role."""
    svc = services()
    nats = build_parser().parse_args(svc["nats"]["command"])
    assert nats.auth
    creds_volume = next(v.split(":")[0] for v in svc["nats"]["volumes"] if v.endswith(nats.creds_dir))
    for name, role in (("generator", "generator"), ("generator-gpu", "generator"), ("relay", "relay")):
        path = svc[name]["environment"]["TOKENPIPE_NATS_CREDS"]
        assert path == f"{nats.creds_dir}/{role}.json"  # the file natsauth.ensure_credentials writes
        assert f"{creds_volume}:{nats.creds_dir}:ro" in svc[name]["volumes"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert nats.creds_dir in dockerfile and nats.data_dir in dockerfile  # created, owned by the image's user


def test_environment_names_are_settings_or_otel_variables() -> None:
    known = {ENV_PREFIX + f.name.upper() for f in fields(Settings)}
    for name, svc in services().items():
        for key in svc.get("environment") or {}:
            if key.startswith(ENV_PREFIX):
                assert key in known, f"{name}: {key} is not a setting"
            elif key.startswith("OTEL_"):
                assert key in OTEL_VARS, f"{name}: {key}"


def test_ports_agree_between_compose_code_and_prometheus() -> None:
    svc = services()
    relay_cmd = svc["relay"]["command"]
    port = relay_cmd[relay_cmd.index("--port") + 1]
    assert any(p.endswith(f":{port}:{port}") for p in svc["relay"]["ports"])
    assert svc["relay"]["environment"]["TOKENPIPE_NATS_URL"] == "${TOKENPIPE_NATS_URL:-nats://nats:4222}"
    nats = build_parser().parse_args(svc["nats"]["command"])
    assert nats.cmd == "nats" and nats.monitor_port == 8222 and nats.port == 4222
    gen_port = svc["generator"]["environment"]["TOKENPIPE_METRICS_PORT"]
    prom = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    assert jobs["tokenpipe-relay"]["static_configs"][0]["targets"] == [f"relay:{port}"]
    dns = jobs["tokenpipe-generator"]["dns_sd_configs"][0]
    assert str(dns["port"]) == gen_port and set(dns["names"]) == {"generator", "generator-gpu"}
    exporter = svc["nats-exporter"]["command"]
    assert jobs["nats"]["static_configs"][0]["targets"] == [f"nats-exporter:{exporter[exporter.index('-port') + 1]}"]
    assert "http://nats:8222" in exporter
    assert svc["generator-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
    assert (ROOT / ".env").read_text().strip() == "COMPOSE_PROFILES=cpu"


def test_otlp_endpoints_reach_the_collector_and_the_collector_reaches_jaeger() -> None:
    svc = services()
    col = yaml.safe_load((ROOT / "deploy/otel-collector.yaml").read_text())
    protocols = col["receivers"]["otlp"]["protocols"]
    ports = {"grpc": protocols["grpc"]["endpoint"].rsplit(":", 1)[1],
             "http/protobuf": protocols["http"]["endpoint"].rsplit(":", 1)[1]}
    for name in ("generator", "relay"):
        env = svc[name]["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"http://otel-collector:{ports[env['OTEL_EXPORTER_OTLP_PROTOCOL']]}"
    pipeline = col["service"]["pipelines"]["traces"]
    assert set(pipeline["receivers"]) <= set(col["receivers"])
    assert set(pipeline["exporters"]) <= set(col["exporters"])
    assert set(pipeline["processors"]) <= set(col["processors"])
    assert col["exporters"]["otlp/jaeger"]["endpoint"].startswith("jaeger:")
    mounted = [v.split(":")[0] for v in svc["otel-collector"]["volumes"]]
    assert "./deploy/otel-collector.yaml" in mounted


def _series_names() -> set[str]:
    names: set[str] = set()
    for registry in (GeneratorMetrics("m").registry, RelayMetrics().registry):
        for family in registry.collect():
            names.add(family.name)
            for suffix in ("_total", "_bucket", "_sum", "_count"):
                names.add(family.name + suffix)
    return names


def test_dashboard_is_valid_and_queries_only_existing_series() -> None:
    dash = json.loads((ROOT / "deploy/grafana/dashboards/tokenpipe.json").read_text())
    ds = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yaml").read_text())
    uid = ds["datasources"][0]["uid"]
    known = _series_names()
    titles = [p["title"] for p in dash["panels"]]
    for wanted in ("Time to first token", "Inter-token latency", "Output tokens/s", "Queue depth and running",
                   "Batch size (sequences per step)", "Active SSE streams"):
        assert wanted in titles
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == uid
        for t in p["targets"]:
            for metric in re.findall(r"\b(tokenpipe_[a-z_]+)\b", t["expr"]):
                assert metric in known, f"{p['title']}: {metric} is not exported"
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/tokenpipe.yaml").read_text())
    path = provider["providers"][0]["options"]["path"]
    assert any(v.endswith(":" + path + ":ro") for v in services()["grafana"]["volumes"])


def test_dockerfile_copies_every_package() -> None:
    text = (ROOT / "Dockerfile").read_text()
    for pkg in ("tokenpipe", "producer", "generator", "relay"):
        assert f"COPY {pkg} ./{pkg}" in text


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_cluster_profile_is_three_nodes_routed_to_each_other_as_the_code_runs_them() -> None:
    svc = services()
    nodes = {name: s for name, s in svc.items() if "cluster" in (s.get("profiles") or ())}
    assert sorted(nodes) == ["nats-1", "nats-2", "nats-3"]
    ports = {}
    for name, node in nodes.items():
        cmd = node["command"]
        assert "-js" in cmd and _flag(cmd, "--server_name") == name
        ports[name] = _flag(cmd, "--cluster").rsplit(":", 1)[1]
        # The same flags `tokenpipe nats --cluster-name ... --routes ...` gives the binary.
        args = node_args(_flag(cmd, "--cluster_name"), int(ports[name]), _flag(cmd, "--routes"), name)
        assert args.argv("0.0.0.0") == cmd[cmd.index("--cluster_name"):]
        assert {r.split("//")[1].split(":")[0] for r in args.routes} == set(nodes) - {name}
        assert len({v.split(":")[0] for v in node["volumes"]}) == 1
    for node in nodes.values():
        for route in _flag(node["command"], "--routes").split(","):
            host, port = route.split("//")[1].split(":")
            assert ports[host] == port
    assert len({n["volumes"][0].split(":")[0] for n in nodes.values()}) == 3  # a store each
    assert {n["volumes"][0].split(":")[0] for n in nodes.values()} <= set(compose()["volumes"])
    # The header tells how to point the roles at the nodes; every node it names exists.
    header = next(line for line in (ROOT / "compose.yaml").read_text().splitlines() if "TOKENPIPE_NATS_URL=" in line)
    urls = server_list(header.split("TOKENPIPE_NATS_URL=")[1].split()[0])
    assert sorted(u.split("//")[1].split(":")[0] for u in urls) == sorted(nodes)
    assert all(u.endswith(":4222") for u in urls)
