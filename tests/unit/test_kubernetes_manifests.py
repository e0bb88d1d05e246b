"""deploy/kubernetes: every `cadence` command in the manifests parses with the real CLI
parsers, and the pieces fit together (the router's selector and port match the replicas,
the probes hit routes that exist, the RBAC grants what discovery does)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import yaml

from cadence.entrypoints.http_server import OPEN_ROUTES
from cadence.router.cli import parse_config
from cadence.router.config import RouterConfig
from cadence.router.server import Router
from cadence.server_args import ServerArgs, add_cli_args, from_cli_args

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
# What Kubernetes and LeaderWorkerSet put in $(VAR) (LWS_WORKER_INDEX: 0 on a group's
# leader, 1 on its other pod).
ENV = {
    "POD_NAMESPACE": "serving",
    "LWS_GROUP_SIZE": "2",
    "LWS_LEADER_ADDRESS": "cadence-tp-0.cadence-tp.serving",
}


def documents() -> list[dict]:
    docs = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


def pod_templates(doc: dict) -> list[dict]:
    """The pod templates of a Deployment, or of a LeaderWorkerSet's leader and workers."""
    spec = doc.get("spec", {})
    if doc["kind"] == "Deployment":
        return [spec["template"]]
    if doc["kind"] == "LeaderWorkerSet":
        lwt = spec["leaderWorkerTemplate"]
        return [lwt["leaderTemplate"], lwt["workerTemplate"]]
    return []


def containers(kind_filter: str) -> list[tuple[dict, dict, list[str]]]:
    """(pod template, container, args with $(VAR) filled in) of every `cadence KIND`."""
    found = []
    for doc in documents():
        for index, template in enumerate(pod_templates(doc)):
            env = {**ENV, "LWS_WORKER_INDEX": str(index)}
            for container in template["spec"]["containers"]:
                args = [re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], a) for a in container["args"]]
                if args[0] == kind_filter:
                    found.append((template, container, args[1:]))
    return found


def serve_args(argv: list[str]) -> ServerArgs:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return from_cli_args(parser.parse_args(argv))


def labels_of(template: dict) -> dict[str, str]:
    return template["metadata"].get("labels", {})


def http_port(container: dict) -> int:
    return next(p["containerPort"] for p in container.get("ports", []) if p["name"] == "http")


@pytest.fixture(scope="module")
def router() -> tuple[dict, dict, RouterConfig]:
    ((template, container, argv),) = containers("router")
    return template, container, parse_config(argv)


def test_every_manifest_is_a_named_kubernetes_object_with_the_image_placeholder():
    docs = documents()
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "LeaderWorkerSet", "Role"}
    for doc in docs:
        assert doc["apiVersion"] and doc["metadata"]["name"]
        for template in pod_templates(doc):
            assert {c["image"] for c in template["spec"]["containers"]} == {"cadence:latest"}
            assert template["spec"]["enableServiceLinks"] is False


def test_the_servers_flags_parse_and_their_probes_hit_the_health_route(router):
    _, _, config = router
    servers = containers("serve")
    assert len(servers) == 3  # the replicas, the group leader and the group's other pods
    for template, container, argv in servers:
        args = serve_args(argv)
        discovered = set(config.selector) <= {f"{k}={v}" for k, v in labels_of(template).items()}
        if "ports" not in container:  # a group's other pods: ranks only, nothing to route to
            assert args.node_rank > 0 and not discovered and "readinessProbe" not in container
            continue
        assert discovered, f"the router's selector misses {labels_of(template)}"
        assert args.host == "0.0.0.0" and args.port == http_port(container)
        assert config.service_discovery_port == args.port
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"]["path"] in OPEN_ROUTES
            assert container[probe]["httpGet"]["port"] == "http"


def test_a_group_shards_over_its_pods_with_leaderworkerset_values():
    (lws,) = [d for d in documents() if d["kind"] == "LeaderWorkerSet"]
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    group = [serve_args(argv) for _, _, argv in containers("serve") if "--nnodes" in argv]
    assert [a.nnodes for a in group] == [size, size] == [int(ENV["LWS_GROUP_SIZE"])] * 2
    assert [a.node_rank for a in group] == [0, 1]  # the leader is node 0: it serves HTTP
    assert all(a.dist_init_addr == ENV["LWS_LEADER_ADDRESS"] + ":29500" for a in group)
    assert all(a.tp_size * a.pp_size % a.nnodes == 0 for a in group)


def test_the_router_discovers_in_its_namespace_and_its_probes_are_router_routes(router):
    template, container, config = router
    assert config.service_discovery and config.host == "0.0.0.0"
    assert config.service_discovery_namespace == ENV["POD_NAMESPACE"]
    assert config.port == http_port(container)
    paths = {r.resource.canonical for r in Router(config, []).build_app().router.routes()}
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["path"] in paths
    docs = documents()
    (role,) = [d for d in docs if d["kind"] == "Role"]
    (binding,) = [d for d in docs if d["kind"] == "RoleBinding"]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == template["spec"]["serviceAccountName"]


def test_every_service_selects_pods_that_exist():
    docs = documents()
    pod_labels = [labels_of(t) for d in docs for t in pod_templates(d)]
    for service in (d for d in docs if d["kind"] == "Service"):
        selector = service["spec"]["selector"]
        assert any(selector.items() <= labels.items() for labels in pod_labels), selector


def test_every_field_is_one_the_kubernetes_api_knows():
    """Each object read into the Kubernetes client's model of its kind and written back is
    unchanged: a misspelt or misplaced field would be dropped on the way."""
    from kubernetes.client import models

    kinds = {
        "Deployment": models.V1Deployment,
        "Service": models.V1Service,
        "ServiceAccount": models.V1ServiceAccount,
        "Role": models.V1Role,
        "RoleBinding": models.V1RoleBinding,
    }
    checked = 0
    for doc in documents():
        if doc["kind"] == "LeaderWorkerSet":  # a CRD: its pod templates are core objects
            parts = [(models.V1PodTemplateSpec, t) for t in pod_templates(doc)]
        else:
            parts = [(kinds[doc["kind"]], doc)]
        for model, part in parts:
            assert model.from_dict(part).model_dump(by_alias=True, exclude_none=True) == part
            checked += 1
    assert checked == len(documents()) + 1  # the LeaderWorkerSet counts its two templates
