"""deploy/helm/tokenpipe without a cluster: render it (tests/helmrender.py), parse every manifest,
validate it against the Kubernetes schema (kubernetes-validate, offline), and check it against the
code: settings, probe routes and ports, the KEDA trigger's names, the drain timeout, NATS users."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import yaml

from generator.service.health import HEALTH_PATHS
from generator.service.placed import slot_for
from relay.app import create_app
from tokenpipe.natsauth import Credential, app_user
from tokenpipe.natsconfig import accounts, chart_accounts, password_env
from tokenpipe.settings import ENV_PREFIX, Settings
from tokenpipe.subjects import REQUESTS_STREAM, consumer_name, slot_consumer_name

from .helmrender import render_chart

CHART = Path(__file__).resolve().parent.parent / "deploy" / "helm" / "tokenpipe"

VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "cpu-demo": {"generator": {"gpu": {"enabled": False}, "device": "cpu", "tolerations": [],
                               "model": "tiny-random", "maxBatch": 8},
                 "keda": {"enabled": False}, "auth": {"createSecret": True, "passwords": {"relay": "x"}}},
    "everything-on": {"relay": {"ingress": {"enabled": True, "tlsSecret": "tls"}},
                      "otel": {"endpoint": "http://otel-collector:4318"}, "auth": {"apiKeysSecret": "keys"},
                      "generator": {"nodeSelector": {"gpu": "h100"}}, "keda": {"lagThreshold": 4}},
}


def manifests(overrides: dict[str, Any]) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for name, text in render_chart(CHART, overrides).items():
        for doc in yaml.safe_load_all(text):
            if doc is not None:
                assert {"apiVersion", "kind", "metadata"} <= set(doc), (name, doc)
                docs.append(doc)
    return docs


def one(docs: list[dict[str, Any]], kind: str, suffix: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
    assert len(found) == 1, (kind, suffix, [d["metadata"]["name"] for d in docs])
    return found[0]


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def env(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_manifest_renders_parses_and_matches_the_kubernetes_schema(variant: str) -> None:
    kv = pytest.importorskip("kubernetes_validate")
    docs = manifests(VARIANTS[variant])
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "StatefulSet", "Service", "PodDisruptionBudget"} <= kinds
    for doc in docs:
        if doc["apiVersion"].startswith("keda.sh/"):
            continue  # a CRD: no schema in the Kubernetes OpenAPI
        kv.validate(doc, "1.30.0", strict=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_tokenpipe_variable_is_a_real_setting(variant: str) -> None:
    known = {ENV_PREFIX + f.name.upper() for f in fields(Settings)}
    for doc in manifests(VARIANTS[variant]):
        if doc["kind"] in ("Deployment", "StatefulSet"):
            names = set(env(container(doc)))
            assert {n for n in names if n.startswith(ENV_PREFIX)} <= known, names - known


def test_probes_hit_routes_the_roles_serve_on_the_ports_they_listen_on() -> None:
    docs = manifests({})
    relay = container(one(docs, "Deployment", "-relay"))
    routes = {getattr(r, "path", None) for r in create_app(Settings.load(env={})).routes}
    port = {p["name"]: p["containerPort"] for p in relay["ports"]}
    for probe in ("livenessProbe", "readinessProbe"):
        assert relay[probe]["httpGet"]["path"] in routes
        assert port[relay[probe]["httpGet"]["port"]] == int(env(relay)["TOKENPIPE_PORT"])
    assert {"/healthz", "/readyz", "/metrics"} <= routes
    gen = container(one(docs, "StatefulSet", "-generator"))
    port = {p["name"]: p["containerPort"] for p in gen["ports"]}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert gen[probe]["httpGet"]["path"] in HEALTH_PATHS
        assert port[gen[probe]["httpGet"]["port"]] == int(env(gen)["TOKENPIPE_METRICS_PORT"])
    assert gen["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert env(gen)["TOKENPIPE_METRICS_HOST"] == "0.0.0.0"
    for dep in (one(docs, "Deployment", "-relay"), one(docs, "StatefulSet", "-generator")):
        ann = dep["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] in routes | set(HEALTH_PATHS)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_grace_period_covers_the_drain(variant: str) -> None:
    gen = one(manifests(VARIANTS[variant]), "StatefulSet", "-generator")
    drain = float(env(container(gen))["TOKENPIPE_DRAIN_TIMEOUT_S"])
    assert drain + 5 <= gen["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]


@pytest.mark.parametrize("variant", ["default", "everything-on"])
def test_keda_scales_the_generators_on_the_consumer_the_code_creates(variant: str) -> None:
    docs = manifests(VARIANTS[variant])
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    scaled = one(docs, "ScaledObject", "-generator")
    gen = one(docs, "StatefulSet", "-generator")
    assert scaled["spec"]["scaleTargetRef"]["name"] == gen["metadata"]["name"]
    assert "replicas" not in gen["spec"]  # KEDA owns the replica count
    assert scaled["spec"]["scaleTargetRef"]["kind"] == gen["kind"] == "StatefulSet"
    model = env(container(gen))["TOKENPIPE_MODEL"]
    slots = int(env(container(gen))["TOKENPIPE_PLACEMENT_SLOTS"])
    triggers = {t["name"]: t for t in scaled["spec"]["triggers"]}
    # every consumer a request can wait on: the shared one and each placement slot's
    assert {t["metadata"]["consumer"] for t in triggers.values()} == \
        {consumer_name(model), *(slot_consumer_name(model, k) for k in range(slots))}
    max_batch = int(env(container(gen))["TOKENPIPE_MAX_BATCH"])
    expected = VARIANTS[variant].get("keda", {}).get("lagThreshold") or max_batch
    for trigger in triggers.values():
        meta = trigger["metadata"]
        assert trigger["type"] == "nats-jetstream" and meta["stream"] == REQUESTS_STREAM
        assert meta["lagThreshold"] == str(expected)
    modifiers = scaled["spec"]["advanced"]["scalingModifiers"]
    assert sorted(modifiers["formula"].split(" + ")) == sorted(triggers)  # their sum, each once
    assert modifiers["target"] == str(expected) and modifiers["metricType"] == "AverageValue"
    assert scaled["spec"]["minReplicaCount"] == values["keda"]["minReplicas"] >= 1
    assert scaled["spec"]["maxReplicaCount"] == values["keda"]["maxReplicas"] > values["keda"]["minReplicas"]
    for trigger in triggers.values():
        assert trigger["metadata"]["natsServerMonitoringEndpoint"] == \
            f"tp-nats.default.svc.cluster.local:{values['nats']['config']['monitor']['port']}"


def test_gpu_request_and_the_cpu_variant() -> None:
    gpu = container(one(manifests({}), "StatefulSet", "-generator"))
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1 and env(gpu)["TOKENPIPE_DEVICE"] == "cuda"
    cpu_docs = manifests(VARIANTS["cpu-demo"])
    cpu = container(one(cpu_docs, "StatefulSet", "-generator"))
    assert "nvidia.com/gpu" not in cpu["resources"]["limits"] and env(cpu)["TOKENPIPE_DEVICE"] == "cpu"
    assert not [d for d in cpu_docs if d["kind"] == "ScaledObject"]
    spec = one(manifests(VARIANTS["everything-on"]), "StatefulSet", "-generator")["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"gpu": "h100"} and spec["tolerations"][0]["key"] == "nvidia.com/gpu"


def test_the_ingress_does_not_buffer_sse_and_waits_long() -> None:
    docs = manifests(VARIANTS["everything-on"])
    ann = one(docs, "Ingress", "-relay")["metadata"]["annotations"]
    assert ann["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    assert int(ann["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 3600
    assert not [d for d in manifests({}) if d["kind"] == "Ingress"]  # off by default


def test_credentials_and_api_keys_come_from_secrets() -> None:
    docs = manifests(VARIANTS["everything-on"])
    for kind, suffix, user in (("Deployment", "-relay", "relay"), ("StatefulSet", "-generator", "generator")):
        e = env(container(one(docs, kind, suffix)))
        assert e["TOKENPIPE_NATS_USER"] == user and e["TOKENPIPE_NATS_INBOX_PREFIX"] == f"_INBOX.{user}"
        assert e["TOKENPIPE_NATS_PASSWORD"]["secretKeyRef"]["key"] == user
        assert e["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4318"
    relay = one(docs, "Deployment", "-relay")["spec"]["template"]["spec"]
    assert relay["volumes"][0]["secret"]["secretName"] == "keys"
    assert env(relay["containers"][0])["TOKENPIPE_API_KEYS_FILE"].startswith(relay["containers"][0]
                                                                            ["volumeMounts"][0]["mountPath"])


def test_nats_is_the_official_chart_with_tokenpipes_users_and_permissions() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    (dep,) = chart["dependencies"]
    assert dep["name"] == "nats" and dep["repository"] == "https://nats-io.github.io/k8s/helm/charts/"
    nats = yaml.safe_load((CHART / "values.yaml").read_text())["nats"]
    assert nats["config"]["cluster"] == {"enabled": True, "replicas": 3}
    assert nats["config"]["jetstream"]["fileStore"]["pvc"]["enabled"]
    layout = nats["config"]["merge"]["accounts"]
    assert layout == chart_accounts(), "regenerate values.yaml's accounts from tokenpipe.natsconfig.chart_accounts()"
    # The same layout `tokenpipe up` serves: accounts, imports, exports, users and permissions; only
    # the passwords differ (the environment here, bcrypt hashes there).
    creds = {u: Credential(u, "pw", o) for u, o in [("relay", "relay"), ("generator", "relay"), ("admin", "relay"),
                                                     (app_user("default"), "default")]}
    served = accounts(creds, passwords={u: "" for u in creds})

    def without_passwords(acc: dict[str, Any]) -> dict[str, Any]:
        return {name: {**a, "users": [{**u, "password": ""} for u in a["users"]]} for name, a in acc.items()}

    assert without_passwords(layout) == served
    users = [u for a in layout.values() for u in a["users"]]
    for user in users:
        assert user["password"] == f"<< ${password_env(user['user'])} >>"
        ref = nats["container"]["env"][password_env(user["user"])]["valueFrom"]["secretKeyRef"]
        assert ref["key"] == user["user"]
    assert not [d for d in manifests({}) if d["kind"] == "StatefulSet" and "nats" in d["metadata"]["name"]], \
        "NATS is the official chart's"


def test_only_the_provisioner_runs_as_the_admin() -> None:
    """Stream creation and configuration are the admin's: one provisioner Deployment, never a role."""
    docs = manifests({})
    prov = container(one(docs, "Deployment", "-provisioner"))
    assert prov["args"] == ["provision", "--watch"]
    assert env(prov)["TOKENPIPE_NATS_USER"] == "admin"
    assert env(prov)["TOKENPIPE_NATS_PASSWORD"]["secretKeyRef"]["key"] == "admin"
    for kind, role in (("Deployment", "-relay"), ("StatefulSet", "-generator")):
        assert env(container(one(docs, kind, role)))["TOKENPIPE_NATS_USER"] != "admin"


@pytest.mark.parametrize("variant", VARIANTS)
def test_generator_pod_n_holds_placement_slot_n_and_every_role_counts_the_same_slots(variant: str) -> None:
    """Regression (issue 47): the generators were a Deployment, whose pod names end in a random suffix, so no
    generator held a slot and placement did nothing in the chart."""
    docs = manifests(VARIANTS[variant])
    gen = one(docs, "StatefulSet", "-generator")
    service = one(docs, "Service", "-generator")
    assert gen["spec"]["serviceName"] == service["metadata"]["name"] and service["spec"]["clusterIP"] == "None"
    assert gen["spec"]["podManagementPolicy"] == "Parallel"
    settings = Settings.load(env={k: v for k, v in env(container(gen)).items() if isinstance(v, str)})
    assert settings.placement_slots > 0
    pods = [f"{gen['metadata']['name']}-{n}" for n in range(settings.placement_slots + 2)]  # StatefulSet names
    assert [slot_for(settings, pod) for pod in pods] == [*range(settings.placement_slots), -1, -1]
    for role in ("-relay", "-provisioner"):
        assert env(container(one(docs, "Deployment", role)))["TOKENPIPE_PLACEMENT_SLOTS"] == \
            str(settings.placement_slots)


def test_placement_off_renders_a_chart_scaled_on_the_shared_consumer_alone() -> None:
    """`generator.placementSlots: 0` (placement off, as values.yaml documents): no slot triggers, the
    formula the shared consumer's lag alone. The renderer's empty `range` once failed on its body."""
    docs = manifests({"generator": {"placementSlots": 0}})
    scaled = one(docs, "ScaledObject", "-generator")
    assert [t["name"] for t in scaled["spec"]["triggers"]] == ["shared"]
    assert scaled["spec"]["advanced"]["scalingModifiers"]["formula"] == "shared"
    assert env(container(one(docs, "StatefulSet", "-generator")))["TOKENPIPE_PLACEMENT_SLOTS"] == "0"
