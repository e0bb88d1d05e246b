"""Which pods are workers: readiness, selectors, roles, addresses, the bootstrap port."""

from __future__ import annotations

import copy

import pytest

from cadence.router.pods import (
    is_pod_ready,
    labels_match,
    pod_key,
    pod_role,
    pod_worker,
    selector_string,
    wanted_worker,
)

READY_POD = {
    "metadata": {
        "name": "cadence-0",
        "namespace": "serving",
        "labels": {"app": "cadence", "role": "prefill"},
        "annotations": {"sglang.ai/bootstrap-port": "8998"},
    },
    "status": {
        "phase": "Running",
        "podIP": "10.1.2.3",
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "True"},
        ],
    },
}
APP = (("app", "cadence"),)
PD = {"prefill": (("role", "prefill"),), "decode": (("app", "cadence"),)}


def pod_with(**changes) -> dict:
    """READY_POD with `section__key=value` changes (value None deletes the key)."""
    pod = copy.deepcopy(READY_POD)
    for path, value in changes.items():
        section, key = path.split("__")
        if value is None:
            pod[section].pop(key, None)
        else:
            pod[section][key] = value
    return pod


def test_a_running_pod_with_ready_true_and_an_ip_is_ready():
    assert is_pod_ready(READY_POD)


@pytest.mark.parametrize(
    "pod",
    [
        pod_with(status__phase="Pending"),
        pod_with(status__phase="Succeeded"),
        pod_with(status__podIP=None),
        pod_with(status__conditions=[{"type": "Ready", "status": "False"}]),
        pod_with(status__conditions=[{"type": "ContainersReady", "status": "True"}]),
        pod_with(status__conditions=None),
        pod_with(metadata__deletionTimestamp="2026-01-01T00:00:00Z"),
        {"metadata": {"name": "bare"}},
    ],
)
def test_pods_that_are_not_ready(pod):
    assert not is_pod_ready(pod)


def test_every_label_of_a_selector_must_match():
    assert labels_match(READY_POD, (("app", "cadence"), ("role", "prefill")))
    assert not labels_match(READY_POD, (("app", "cadence"), ("role", "decode")))
    assert not labels_match(READY_POD, (("tier", "gold"),))
    assert not labels_match(READY_POD, ())  # an empty selector chooses nothing
    assert selector_string((("app", "cadence"), ("role", "prefill"))) == "app=cadence,role=prefill"
    assert pod_key(READY_POD) == "serving/cadence-0"


def test_a_pod_chosen_by_both_pd_selectors_is_a_prefill_worker():
    assert pod_role(READY_POD, PD) == "prefill"
    assert pod_role(pod_with(metadata__labels={"app": "cadence"}), PD) == "decode"
    assert pod_role(pod_with(metadata__labels={}), PD) is None


def test_a_ready_pod_is_the_worker_at_its_ip_and_the_discovery_port():
    spec = pod_worker(READY_POD, "prefill", 30000)
    assert (spec.url, spec.role, spec.bootstrap_port) == ("http://10.1.2.3:30000", "prefill", 8998)
    decode = pod_worker(READY_POD, "decode", 30000)
    assert decode.bootstrap_port is None  # only prefill workers have one
    ipv6 = pod_worker(pod_with(status__podIP="fd00::5"), "regular", 80)
    assert ipv6.url == "http://[fd00::5]"


@pytest.mark.parametrize("annotation", ["", "none", "0", "70000", "-1", "8998x"])
def test_an_unusable_bootstrap_annotation_leaves_the_port_to_server_info(annotation):
    pod = pod_with(metadata__annotations={"sglang.ai/bootstrap-port": annotation})
    assert pod_worker(pod, "prefill", 30000).bootstrap_port is None


def test_wanted_worker_is_none_for_other_roles_and_unready_pods_and_refuses_metadata_ips():
    assert wanted_worker(READY_POD, "prefill", PD, 30000) is not None
    assert wanted_worker(READY_POD, "decode", PD, 30000) is None  # prefill wins
    assert wanted_worker(pod_with(status__phase="Pending"), "prefill", PD, 30000) is None
    assert wanted_worker(READY_POD, "regular", {"regular": APP}, 30000) is not None
    with pytest.raises(ValueError, match="pod serving/cadence-0: .*link-local or cloud metadata"):
        wanted_worker(pod_with(status__podIP="169.254.169.254"), "prefill", PD, 30000)
