"""The llm-d recipe: deploy/kubernetes's manifests validated offline against
Kubernetes' schemas (`kubernetes-validate`, strict: an unknown field fails) and, for the two
custom resources, against the Inference Extension's and Gateway API's documented v1 fields;
the pieces refer to each other (labels, ports, names, config maps); the EPP's configuration is
one scoring in both recipes, and it reads Corral's exposition by names Corral publishes."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from corral.gateway.servers.epp import ProtocolMetrics
from tests.support.epp_router import (
    EPP_CONFIG,
    HostMetrics,
    Names,
    PickerConfig,
    pick,
    read_metrics,
)

pytestmark = pytest.mark.unit

KUBE = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
KUBERNETES = "1.32.0"  # the oldest Kubernetes the manifests are checked for (grpc probes: 1.27)

# The documented v1 fields (gateway-api-inference-extension.sigs.k8s.io/reference/spec): the
# required ones, their shapes, no others (the CRD's schema prunes unknown fields).
_PORT = {
    "type": "object", "required": ["number"], "additionalProperties": False,
    "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}},
}  # fmt: skip
INFERENCE_POOL = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "spec": {
            "type": "object",
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "required": ["matchLabels"],
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "minProperties": 1,
                            "additionalProperties": {"type": "string"},
                        }
                    },
                },
                "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": _PORT},
                "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
                "endpointPickerRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "group": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": {"type": "string", "minLength": 1},
                        "port": _PORT,
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                },
            },
        },
    },
}
HTTP_ROUTE = {  # the fields the recipe uses, as Gateway API v1 defines them
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "gateway.networking.k8s.io/v1"},
        "kind": {"const": "HTTPRoute"},
        "spec": {
            "type": "object",
            "required": ["parentRefs", "rules"],
            "properties": {
                "parentRefs": {
                    "type": "array",
                    "minItems": 1,
                    "items": {"type": "object", "required": ["name"]},
                },
                "rules": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "matches": {"type": "array"},
                            "backendRefs": {
                                "type": "array",
                                "items": {"type": "object", "required": ["name"]},
                            },
                            "timeouts": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {
                                    "request": {"type": "string", "pattern": r"^\d+(ms|s|m|h)$"},
                                    "backendRequest": {"type": "string"},
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}
CUSTOM = {"InferencePool": INFERENCE_POOL, "HTTPRoute": HTTP_ROUTE}


def documents() -> list[tuple[str, dict[str, Any]]]:
    kustomization = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
    out = []
    for name in kustomization["resources"]:
        for doc in yaml.safe_load_all((KUBE / name).read_text()):
            out.append((name, doc))
    return out


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [d for _, d in documents() if d["kind"] == kind]


def test_the_kustomization_names_every_manifest_in_the_folder() -> None:
    kustomization = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
    files = {p.name for p in KUBE.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)
    images = {i["name"] for i in kustomization["images"]}
    used = {c["image"] for d in of_kind("StatefulSet") + of_kind("Deployment")
            for c in d["spec"]["template"]["spec"]["containers"]}  # fmt: skip
    assert used == images  # every image the pods name is one the kustomization sets


@pytest.mark.parametrize(
    ("name", "doc"), documents(), ids=lambda x: x if isinstance(x, str) else ""
)
def test_each_manifest_is_valid_against_kubernetes_schemas(name: str, doc: dict[str, Any]) -> None:
    if doc["kind"] in CUSTOM:
        jsonschema.validate(doc, CUSTOM[doc["kind"]])
    else:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    assert doc["metadata"].get("namespace", "corral") == "corral", name


def test_a_field_kubernetes_does_not_know_fails_the_check() -> None:
    (sts,) = of_kind("StatefulSet")
    sts["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, KUBERNETES, strict=True)
    (pool,) = of_kind("InferencePool")
    pool["spec"]["targetPorts"] = [{"number": 8080}] * 9
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool, INFERENCE_POOL)


def test_the_pieces_refer_to_each_other() -> None:
    (sts,) = of_kind("StatefulSet")
    (pool,) = of_kind("InferencePool")
    (route,) = of_kind("HTTPRoute")
    pod = sts["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    # The pool selects Corral's pods, on the port Corral listens on.
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (port,) = container["ports"]
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [port["containerPort"]]
    # ...which is the one corral.yaml listens on, and the probes ask Corral's health route.
    (config,) = [c for c in of_kind("ConfigMap") if c["metadata"]["name"] == "corral-config"]
    corral = yaml.safe_load(config["data"]["corral.yaml"])
    assert corral["server"]["listen"].endswith(f":{port['containerPort']}")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": port["name"]}
    assert "--models" in container["args"]
    # The pool's picker is the EPP's Service, on its ext_proc port.
    (svc,) = [s for s in of_kind("Service") if s["metadata"]["name"] == "corral-epp"]
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["name"] == svc["metadata"]["name"]
    assert ref["port"]["number"] in [p["port"] for p in svc["spec"]["ports"]]
    (epp,) = of_kind("Deployment")
    args = epp["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--grpc-port={ref['port']['number']}" in args
    # The route sends to the pool; the mounted config maps exist.
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert (backend["kind"], backend["name"]) == ("InferencePool", pool["metadata"]["name"])
    maps = {c["metadata"]["name"]: c for c in of_kind("ConfigMap")}
    for workload in (sts, epp):
        for volume in workload["spec"]["template"]["spec"]["volumes"]:
            if "configMap" in volume:
                assert volume["configMap"]["name"] in maps
    # The EPP reads its config where the map is mounted, and the engine label names the
    # core-metrics-extractor's engine config.
    (mount,) = epp["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    (file,) = maps["corral-epp-config"]["data"]
    assert f"--config-file={mount['mountPath']}/{file}" in args
    epp_config = yaml.safe_load(maps["corral-epp-config"]["data"][file])
    (extractor,) = [p for p in epp_config["plugins"] if p["type"] == "core-metrics-extractor"]
    engines = {e["name"] for e in extractor["parameters"]["engineConfigs"]}
    assert pod["metadata"]["labels"]["llm-d.ai/engine-type"] in engines


def test_the_kubernetes_and_file_recipes_score_alike() -> None:
    """The Kubernetes EPP config is the file recipe's without its discovery (the pool's pods
    instead of endpoints.yaml)."""
    (config,) = [c for c in of_kind("ConfigMap") if c["metadata"]["name"] == "corral-epp-config"]
    ((file, text),) = config["data"].items()
    assert file.endswith(".yaml")
    k8s = yaml.safe_load(text)
    src = yaml.safe_load(EPP_CONFIG.read_text())
    (disc,) = [p for p in src["plugins"] if p["type"] == "file-discovery"]
    assert src["dataLayer"]["discovery"]["endpoints"]["pluginRef"] == disc["name"]
    assert k8s["plugins"] == [p for p in src["plugins"] if p is not disc]
    assert k8s["schedulingProfiles"] == src["schedulingProfiles"]
    assert k8s["dataLayer"] == {"sources": src["dataLayer"]["sources"]}
    endpoints = yaml.safe_load((EPP_CONFIG.parent / "endpoints.yaml").read_text())
    for e in endpoints["endpoints"]:  # the file discovery's rules: IPv4, the port a string
        assert re.fullmatch(r"\d+\.\d+\.\d+\.\d+", e["address"])
        assert isinstance(e["port"], str)
        assert 1 <= int(e["port"]) <= 65535


def exposition(status: dict[str, Any], vllm: bool = False) -> str:
    registry = CollectorRegistry()
    registry.register(ProtocolMetrics(lambda: status, vllm))
    return generate_latest(registry).decode()


def host(ready: list[str], loading: tuple[str, ...] = (), queued: int = 0) -> dict[str, Any]:
    models: dict[str, dict[str, Any]] = {
        m: {"state": "ready" if m in ready else "loading" if m in loading else "unloaded",
            "memory_gb": 20, "queued": queued if m in ready else 0, "in_flight": 0,
            "concurrency": 4, "aliases": []}
        for m in ("a", "b", "c")
    }  # fmt: skip
    used = 20 * (len(ready) + len(loading))
    device = {"name": "g", "memory_gb": 24, "used_gb": used, "resident": ready + list(loading)}
    return {"models": models, "devices": [device]}


def test_the_epp_config_reads_corrals_exposition_by_names_corral_publishes() -> None:
    config = PickerConfig.load()
    got = read_metrics(exposition(host(["a"], queued=2)), config.names)
    assert got == HostMetrics(2, 0, 0.0, frozenset({"a"}), frozenset(), 1)
    # The stock vllm mapping's names are published too when asked for.
    stock = Names(
        "vllm:num_requests_waiting", "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc", "vllm:lora_requests_info",
    )  # fmt: skip
    assert read_metrics(exposition(host(["a"], queued=2), vllm=True), stock) == got


def test_the_documented_scores_send_a_request_to_the_host_holding_its_model() -> None:
    config = PickerConfig.load()
    rng = random.Random(0)
    names = config.names

    def hosts(*statuses: dict[str, Any]) -> list[HostMetrics]:
        return [read_metrics(exposition(s), names) for s in statuses]

    # The holder wins even with the longest queue over full hosts...
    assert (
        pick("a", hosts(host(["a"], queued=9), host(["b"]), host(["c"])), config.weights, rng) == 0
    )
    # ...a host where it is loading over full ones...
    assert pick("a", hosts(host(["b"]), host([], ("a",)), host(["c"])), config.weights, rng) == 1
    # ...and an empty host (room: 0.8) takes it when the holder's queue is the longest.
    assert pick("a", hosts(host(["a"], queued=9), host([]), host(["c"])), config.weights, rng) == 1
    # With no queue anywhere, the holder.
    assert pick("a", hosts(host([]), host(["a"]), host(["c"])), config.weights, rng) == 1
