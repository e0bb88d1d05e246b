"""What a Kubernetes pod means to the router: is it chosen, is it ready, which worker is it.

Pure functions over the pod objects of the Kubernetes API as JSON (the `items` of a
PodList and the `object` of a watch event), so that they can be checked without a
cluster. `discovery.py` feeds them what the API server says.
"""

from __future__ import annotations

from cadence.router.config import PREFILL, WorkerSpec, normalize_worker_url

# SGLang router's annotation for a prefill pod's KV bootstrap port.
BOOTSTRAP_PORT_ANNOTATION = "sglang.ai/bootstrap-port"

Selector = tuple[tuple[str, str], ...]


def selector_string(pairs: Selector) -> str:
    """The labelSelector query value the API server filters by: 'app=cadence,tier=a'."""
    return ",".join(f"{key}={value}" for key, value in pairs)


def pod_key(pod: dict) -> str:
    """namespace/name: what identifies a pod across its events."""
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace') or ''}/{meta.get('name') or ''}"


def labels_match(pod: dict, pairs: Selector) -> bool:
    """Whether the pod carries every label of `pairs` (an empty selector chooses nothing)."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return bool(pairs) and all(labels.get(key) == value for key, value in pairs)


def is_pod_ready(pod: dict) -> bool:
    """Running, its Ready condition True, not being deleted, and it has an IP.

    A pod being deleted can still report Ready while it drains; it gets no new requests.
    """
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") != "Running":
        return False
    if not status.get("podIP"):
        return False
    return any(
        isinstance(c, dict) and c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or ()
    )


def pod_role(pod: dict, selectors: dict[str, Selector]) -> str | None:
    """The role whose selector chooses the pod (prefill first, as SGLang's router), or None."""
    for role in sorted(selectors, key=lambda r: r != PREFILL):
        if labels_match(pod, selectors[role]):
            return role
    return None


def pod_worker(pod: dict, role: str, port: int) -> WorkerSpec:
    """The worker a ready pod of `role` is: http://POD_IP:PORT, with a prefill pod's
    bootstrap port from its annotation when it has a valid one (else None: the router
    reads it from the worker's GET /server_info). ValueError when the IP makes no URL."""
    ip = str(pod["status"]["podIP"])
    host = f"[{ip}]" if ":" in ip else ip
    url = normalize_worker_url(f"http://{host}:{port}", field=f"pod {pod_key(pod)}")
    bootstrap_port = bootstrap_port_of(pod) if role == PREFILL else None
    return WorkerSpec(url=url, role=role, bootstrap_port=bootstrap_port)


def bootstrap_port_of(pod: dict) -> int | None:
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    value = annotations.get(BOOTSTRAP_PORT_ANNOTATION)
    if isinstance(value, str) and value.strip().isdigit() and 1 <= int(value) <= 65535:
        return int(value)
    return None


def wanted_worker(
    pod: dict, role: str, selectors: dict[str, Selector], port: int
) -> WorkerSpec | None:
    """The worker this pod should be for the watch of `role` now, or None: not chosen by
    that role's selector, or not ready. ValueError when its IP makes no worker URL."""
    if pod_role(pod, selectors) != role or not is_pod_ready(pod):
        return None
    return pod_worker(pod, role, port)
