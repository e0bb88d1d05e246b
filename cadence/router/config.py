"""Router configuration: one frozen dataclass, worker URL validation, the worker file.

Each `RouterConfig` field's docstring is also its `--help` text (see `cadence.config_docs.field_docs`).
"""

from __future__ import annotations

import ipaddress
import json
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit

POLICIES = ("round_robin", "least_request", "random", "power_of_two", "cache_aware")

# What a worker does: a complete replica, or one side of prefill/decode disaggregation.
REGULAR, PREFILL, DECODE = "regular", "prefill", "decode"
ROLES = (REGULAR, PREFILL, DECODE)

CAPABILITIES = frozenset(
    {
        "chat",
        "completion",
        "embedding",
        "speech",
        "streaming",
        "image_input",
        "audio_input",
        "video_input",
        "audio_output",
    }
)

# Cloud metadata services answer on link-local addresses (169.254.169.254 and the rest of
# 169.254/16, fe80::/10), on these well-known addresses outside them, or on these names; a
# worker URL pointing there would turn the router into a credential-fetching proxy.
_METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a)
    for a in (
        "100.100.100.200",  # Alibaba Cloud
        "192.0.0.192",  # Oracle Cloud (its older metadata address)
        "168.63.129.16",  # Azure's platform endpoint (WireServer)
        "fd00:ec2::254",  # AWS IMDS over IPv6
        "fd20:ce::254",  # Google Compute Engine over IPv6
    )
)
_METADATA_HOSTS = frozenset(
    {
        "metadata",
        "metadata.google.internal",
        "metadata.goog",
        "instance-data",  # AWS
        "instance-data.ec2.internal",
        "metadata.tencentyun.com",  # Tencent Cloud
        "metadata.platformequinix.com",  # Equinix Metal
    }
)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # an IPv4 address carried in IPv6 (RFC 6052)
_DEFAULT_PORTS = {"http": 80, "https": 443}

# Bounds on what a worker entry may hold: whatever the source (flags, file, admin API),
# a worker URL or model name is echoed in state, metrics labels and logs.
MAX_URL_LENGTH = 2048
MAX_MODEL_NAME_LENGTH = 256
MAX_NUM_CAPABILITIES = len(CAPABILITIES)


@dataclass(frozen=True)
class RouterConfig:
    """Everything `cadence router` is started with."""

    host: str = "127.0.0.1"
    """Address to listen on (0.0.0.0 for all interfaces)."""

    port: int = 30080
    """Port to listen on (0 picks a free port)."""

    worker_urls: tuple[str, ...] = ()
    """Base URLs of the workers, http or https, e.g. http://127.0.0.1:30000."""

    worker_config: str | None = None
    """JSON or YAML file listing workers: [{url, model, capabilities, role, bootstrap_port}, ...]."""

    pd_disaggregation: bool = False
    """Prefill/decode disaggregation: each generate request goes to a prefill worker and a
    decode worker at once (--prefill, --decode), and the decode worker answers."""

    prefill_urls: tuple[tuple[str, int | None], ...] = ()
    """PD mode: a prefill worker, as --prefill URL [BOOTSTRAP_PORT]; repeat the flag per worker.
    Without a port (or with 'none') the worker's GET /server_info disaggregation_bootstrap_port is used."""

    decode_urls: tuple[str, ...] = ()
    """PD mode: a decode worker, as --decode URL; repeat the flag per worker."""

    policy: str = "round_robin"
    """Routing policy: round_robin, least_request, random, power_of_two or cache_aware."""

    prefill_policy: str | None = None
    """PD mode: policy choosing the prefill worker (default: --policy)."""

    decode_policy: str | None = None
    """PD mode: policy choosing the decode worker (default: --policy)."""

    pd_local_prefill_max_tokens: int = 0
    """PD mode: a prompt of at most this many tokens (counted from input_ids, estimated from text at 3 bytes a token, chat tools included) goes to a decode worker alone, which prefills it itself: short prompts never queue behind long ones on the prefill workers (conditional disaggregation). 0: every request is disaggregated, as SGLang's router does."""

    service_discovery: bool = False
    """Add and remove workers as Kubernetes pods chosen by --selector (PD mode: --prefill-selector
    and --decode-selector) become ready, stop being ready or go away (docs/kubernetes.md)."""

    selector: tuple[str, ...] = ()
    """Service discovery: labels a worker pod must all carry, as KEY=VALUE (several, or joined by commas)."""

    prefill_selector: tuple[str, ...] = ()
    """Service discovery in PD mode: labels of prefill worker pods, as KEY=VALUE; their
    sglang.ai/bootstrap-port annotation gives the bootstrap port (else GET /server_info does)."""

    decode_selector: tuple[str, ...] = ()
    """Service discovery in PD mode: labels of decode worker pods, as KEY=VALUE (a pod that
    also matches --prefill-selector is a prefill worker)."""

    service_discovery_port: int = 80
    """Service discovery: the port a discovered pod serves HTTP on (its workers are
    http://POD_IP:PORT)."""

    service_discovery_namespace: str | None = None
    """Service discovery: the namespace whose pods are watched (default: all namespaces)."""

    service_discovery_api_server: str | None = None
    """Service discovery: the Kubernetes API server's URL, called without credentials (e.g.
    `kubectl proxy`'s http://127.0.0.1:8001); default: the pod's service account inside a
    cluster, else the kubeconfig."""

    request_timeout_secs: float = 1800.0
    """Longest time one upstream exchange may take, the whole streamed answer included."""

    max_payload_size: int = 512 * 1024 * 1024
    """Largest request body in bytes; larger ones get 413."""

    max_concurrent_requests: int = 1024
    """Most requests routed at once; more get 429 (0: no limit)."""

    health_failure_threshold: int = 3
    """Consecutive failed probes or requests that make a worker unhealthy."""

    health_success_threshold: int = 2
    """Consecutive successful probes that make a worker healthy."""

    health_check_timeout_secs: float = 5.0
    """Time limit of one health probe (and of one worker's /v1/models query)."""

    health_check_interval_secs: float = 10.0
    """Seconds between health probes of a known worker."""

    health_check_startup_interval_secs: float = 1.0
    """Seconds between probes while a worker is still unknown (new or recovered)."""

    health_check_endpoint: str = "/health"
    """Path probed on each worker; 200 means the probe succeeded."""

    retry_max_retries: int = 3
    """Extra attempts, on other workers where possible, for a request that failed before answering (0: none)."""

    retry_initial_backoff_ms: float = 50.0
    """Backoff before the first retry, in milliseconds."""

    retry_max_backoff_ms: float = 2000.0
    """Upper bound of the backoff between retries, in milliseconds."""

    retry_backoff_multiplier: float = 2.0
    """Factor applied to the backoff after each retry."""

    retry_jitter_factor: float = 0.2
    """Random spread of each backoff, as a fraction of it (0 to 1)."""

    cache_threshold: float = 0.5
    """cache_aware: smallest fraction of the prompt prefix a worker must have seen to get the request."""

    balance_abs_threshold: int = 32
    """cache_aware: route by load when the busiest and idlest worker differ by more than this many requests..."""

    balance_rel_threshold: float = 1.5
    """cache_aware: ...and the busiest has more than this many times the idlest's requests."""

    max_tree_size: int = 1 << 24
    """cache_aware: most prompt characters kept in the prefix tree; least recently used go first."""

    route_log: str | None = None
    """File that gets one JSON line per routed request (best effort)."""

    api_key: str | None = None
    """Key clients must send as 'Authorization: Bearer KEY' (all routes but /live, /ready,
    /health and the admin routes); also sent on probes."""

    admin_api_key: str | None = None
    """Key the admin routes (GET/POST /workers, GET/PUT/DELETE /workers/{id}) require as
    'Authorization: Bearer KEY'; must differ from api_key."""

    enable_admin_api: bool = False
    """Serve the admin routes without an admin key (open, or behind api_key when set);
    without this flag or an admin key they answer 403."""

    log_level: str = "info"
    """Logging level: debug, info, warning or error."""

    def __post_init__(self) -> None:
        _check(0 <= self.port <= 65535, "port", "must be between 0 and 65535")
        _check(bool(self.host), "host", "must not be empty")
        _check(self.policy in POLICIES, "policy", f"must be one of {', '.join(POLICIES)}")
        _check(self.request_timeout_secs > 0, "request_timeout_secs", "must be > 0")
        _check(self.max_payload_size > 0, "max_payload_size", "must be > 0")
        _check(self.max_concurrent_requests >= 0, "max_concurrent_requests", "must be >= 0")
        _check(self.health_failure_threshold >= 1, "health_failure_threshold", "must be >= 1")
        _check(self.health_success_threshold >= 1, "health_success_threshold", "must be >= 1")
        _check(self.health_check_timeout_secs > 0, "health_check_timeout_secs", "must be > 0")
        _check(self.health_check_interval_secs > 0, "health_check_interval_secs", "must be > 0")
        _check(
            self.health_check_startup_interval_secs > 0,
            "health_check_startup_interval_secs",
            "must be > 0",
        )
        _check(
            self.health_check_endpoint.startswith("/"),
            "health_check_endpoint",
            "must be a path starting with '/'",
        )
        _check(self.retry_max_retries >= 0, "retry_max_retries", "must be >= 0")
        _check(self.retry_initial_backoff_ms >= 0, "retry_initial_backoff_ms", "must be >= 0")
        _check(self.retry_max_backoff_ms >= 0, "retry_max_backoff_ms", "must be >= 0")
        _check(self.retry_backoff_multiplier >= 1, "retry_backoff_multiplier", "must be >= 1")
        _check(0 <= self.retry_jitter_factor <= 1, "retry_jitter_factor", "must be in [0, 1]")
        _check(0 <= self.cache_threshold <= 1, "cache_threshold", "must be in [0, 1]")
        _check(self.balance_abs_threshold >= 0, "balance_abs_threshold", "must be >= 0")
        _check(self.balance_rel_threshold >= 1, "balance_rel_threshold", "must be >= 1")
        _check(self.max_tree_size > 0, "max_tree_size", "must be > 0")
        _check_key(self.api_key, "api_key")
        _check_key(self.admin_api_key, "admin_api_key")
        _check(
            self.admin_api_key is None or self.admin_api_key != self.api_key,
            "admin_api_key",
            "must differ from api_key, so that a client key never opens worker management",
        )
        _check(isinstance(self.enable_admin_api, bool), "enable_admin_api", "must be true or false")
        _check(
            self.log_level in ("debug", "info", "warning", "error"),
            "log_level",
            "must be debug, info, warning or error",
        )
        seen: set[str] = set()
        for url in self.worker_urls:
            normalized = normalize_worker_url(url, field="worker_urls")
            _check(normalized not in seen, "worker_urls", f"duplicate worker {normalized}")
            seen.add(normalized)
        self._check_pd()
        self._check_discovery()

    def _check_pd(self) -> None:
        """PD mode takes its workers from --prefill/--decode; the two modes never mix."""
        for field in ("prefill_policy", "decode_policy"):
            name = getattr(self, field)
            _check(name is None or name in POLICIES, field, f"must be one of {', '.join(POLICIES)}")
        _check(
            isinstance(self.pd_disaggregation, bool), "pd_disaggregation", "must be true or false"
        )
        _check(
            isinstance(self.pd_local_prefill_max_tokens, int)
            and not isinstance(self.pd_local_prefill_max_tokens, bool)
            and self.pd_local_prefill_max_tokens >= 0,
            "pd_local_prefill_max_tokens",
            "must be a whole number of tokens >= 0",
        )
        if not self.pd_disaggregation:
            _check(
                not self.pd_local_prefill_max_tokens,
                "pd_local_prefill_max_tokens",
                "--pd-local-prefill-max-tokens is a PD mode flag: add --pd-disaggregation, "
                "or drop it",
            )
            for field in ("prefill_urls", "decode_urls", "prefill_policy", "decode_policy"):
                _check(
                    not getattr(self, field),
                    field,
                    f"--{field.removesuffix('_urls').replace('_', '-')} is a PD mode flag: "
                    "add --pd-disaggregation, or drop it",
                )
            return
        _check(
            not self.worker_urls,
            "worker_urls",
            "--worker-urls names complete replicas, which PD mode (--pd-disaggregation) does not "
            "route to: drop --worker-urls and give prefill workers with --prefill URL "
            "[BOOTSTRAP_PORT] and decode workers with --decode URL",
        )
        seen: set[str] = set()
        for entry in self.prefill_urls:
            _check(
                isinstance(entry, tuple) and len(entry) == 2,
                "prefill_urls",
                f"each entry is a (url, bootstrap_port or None) pair, got {short_repr(entry)}",
            )
            url, port = entry
            normalized = normalize_worker_url(url, field="prefill_urls")
            check_bootstrap_port(port, "prefill_urls")
            _check(normalized not in seen, "prefill_urls", f"duplicate worker {normalized}")
            seen.add(normalized)
        for url in self.decode_urls:
            normalized = normalize_worker_url(url, field="decode_urls")
            _check(
                normalized not in seen,
                "decode_urls",
                f"{normalized} is listed twice (a worker is either prefill or decode, once)",
            )
            seen.add(normalized)

    def _check_discovery(self) -> None:
        """Selectors are validated here; which ones apply depends on the mode."""
        _check(
            isinstance(self.service_discovery, bool), "service_discovery", "must be true or false"
        )
        for field in _SELECTOR_FIELDS:
            parse_selector(getattr(self, field), field)
        if not self.service_discovery:
            for field in (*_SELECTOR_FIELDS, "service_discovery_namespace"):
                _check(
                    not getattr(self, field),
                    field,
                    f"--{field.replace('_', '-')} is a service discovery flag: add "
                    "--service-discovery, or drop it",
                )
            _check(
                self.service_discovery_api_server is None,
                "service_discovery_api_server",
                "is a service discovery flag: add --service-discovery, or drop it",
            )
        elif self.pd_disaggregation:
            _check(
                not self.selector,
                "selector",
                "PD mode discovers workers by --prefill-selector and --decode-selector; "
                "--selector has no role: drop it",
            )
            _check(
                bool(self.prefill_selector or self.decode_selector),
                "prefill_selector",
                "service discovery in PD mode needs --prefill-selector and/or --decode-selector "
                "KEY=VALUE ...",
            )
        else:
            _check(
                bool(self.selector),
                "selector",
                "service discovery needs --selector KEY=VALUE ... (the labels of worker pods)",
            )
            for field in ("prefill_selector", "decode_selector"):
                _check(
                    not getattr(self, field),
                    field,
                    f"--{field.replace('_', '-')} is a PD mode flag: add --pd-disaggregation, "
                    "or use --selector",
                )
        _check(
            isinstance(self.service_discovery_port, int)
            and not isinstance(self.service_discovery_port, bool)
            and 1 <= self.service_discovery_port <= 65535,
            "service_discovery_port",
            "must be between 1 and 65535",
        )
        namespace = self.service_discovery_namespace
        _check(
            namespace is None or _is_dns_label(namespace),
            "service_discovery_namespace",
            f"{short_repr(namespace)} is not a namespace name (lowercase letters, digits and "
            "'-', at most 63 characters)",
        )
        server = self.service_discovery_api_server
        if server is not None:
            parts = urlsplit(server) if isinstance(server, str) else None
            _check(
                parts is not None
                and parts.scheme in _DEFAULT_PORTS
                and bool(parts.hostname)
                and not parts.query
                and not parts.fragment,
                "service_discovery_api_server",
                f"must be an http:// or https:// URL, got {short_repr(server)}",
            )

    def selectors(self) -> dict[str, tuple[tuple[str, str], ...]]:
        """Service discovery: the label pairs that choose each role's pods (only the roles
        that have a selector)."""
        if not self.pd_disaggregation:
            return {REGULAR: parse_selector(self.selector, "selector")}
        chosen = {
            PREFILL: parse_selector(self.prefill_selector, "prefill_selector"),
            DECODE: parse_selector(self.decode_selector, "decode_selector"),
        }
        return {role: pairs for role, pairs in chosen.items() if pairs}

    @property
    def is_admin_api_enabled(self) -> bool:
        """Whether the admin routes answer at all: an admin key is set, or --enable-admin-api."""
        return self.admin_api_key is not None or self.enable_admin_api

    @property
    def retry_initial_backoff_secs(self) -> float:
        return self.retry_initial_backoff_ms / 1000.0

    @property
    def retry_max_backoff_secs(self) -> float:
        return self.retry_max_backoff_ms / 1000.0

    def policy_for(self, role: str) -> str:
        """The policy name that chooses workers of `role` (PD mode may set one per side)."""
        chosen = {PREFILL: self.prefill_policy, DECODE: self.decode_policy}.get(role)
        return chosen or self.policy


@dataclass(frozen=True)
class WorkerSpec:
    """One worker as configured: where it is and what it can serve."""

    url: str
    """Normalized base URL (see `normalize_worker_url`)."""

    model: str | None = None
    """Model the worker serves; None matches any requested model."""

    capabilities: frozenset[str] | None = None
    """What the worker can do (see CAPABILITIES); None means everything."""

    role: str = REGULAR
    """regular (a complete replica), or prefill or decode (PD mode only)."""

    bootstrap_port: int | None = None
    """Prefill workers: the port of their KV bootstrap server; None: read from /server_info."""

    @property
    def id(self) -> str:
        return worker_id(self.url)


def worker_id(url: str) -> str:
    """Stable id of a worker: its normalized URL, percent-encoded to fit in one path segment."""
    return quote(url, safe="")


def normalize_worker_url(url: str, field: str = "url") -> str:
    """Validate a worker base URL and return its canonical form.

    Lowercases scheme and host, drops default ports and trailing slashes. Refuses other
    schemes, credentials, query strings, fragments and link-local/metadata hosts.
    """
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"{field}: worker URL must be a non-empty string, got {short_repr(url)}")
    if len(url) > MAX_URL_LENGTH:
        raise ValueError(
            f"{field}: worker URL is {len(url)} characters long; the limit is {MAX_URL_LENGTH}"
        )
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{field}: invalid worker URL {url!r}: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise ValueError(f"{field}: worker URL {url!r} must start with http:// or https://")
    host = parts.hostname
    if not host:
        raise ValueError(f"{field}: worker URL {url!r} has no host")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"{field}: worker URL {url!r} must not carry credentials")
    if parts.query or parts.fragment:
        raise ValueError(f"{field}: worker URL {url!r} must not have a query or fragment")
    if _is_metadata_host(host):
        raise ValueError(
            f"{field}: worker URL {url!r} points at a link-local or cloud metadata address; "
            "give the replica's own address"
        )
    netloc = f"[{host}]" if ":" in host else host
    if port is not None and port != _DEFAULT_PORTS[scheme]:
        netloc = f"{netloc}:{port}"
    return f"{scheme}://{netloc}{parts.path.rstrip('/')}"


def _is_metadata_host(host: str) -> bool:
    if host.rstrip(".").lower() in _METADATA_HOSTS:
        return True
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        addr = _legacy_ipv4(host)
        if addr is None:
            return False
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        elif addr in _NAT64:
            addr = ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)
    return addr.is_link_local or addr in _METADATA_ADDRESSES


def _legacy_ipv4(host: str) -> ipaddress.IPv4Address | None:
    """Hosts like '2852039166' or '0xa9.0xfe.0xa9.0xfe' that resolvers read as IPv4."""
    if not all(c in "0123456789abcdefxABCDEFX." for c in host):
        return None
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        return None


def load_worker_specs(config: RouterConfig) -> list[WorkerSpec]:
    """The workers named by `--worker-urls` (or `--prefill`/`--decode`) and `--worker-config`,
    validated, no duplicates."""
    specs = [WorkerSpec(url=normalize_worker_url(u, "worker_urls")) for u in config.worker_urls]
    specs += [
        WorkerSpec(url=normalize_worker_url(u, "prefill_urls"), role=PREFILL, bootstrap_port=p)
        for u, p in config.prefill_urls
    ]
    specs += [
        WorkerSpec(url=normalize_worker_url(u, "decode_urls"), role=DECODE)
        for u in config.decode_urls
    ]
    if config.worker_config:
        for spec in read_worker_file(config.worker_config):
            check_role(spec, config.pd_disaggregation, "worker_config")
            specs.append(spec)
    seen: set[str] = set()
    for spec in specs:
        if spec.url in seen:
            raise ValueError(f"worker_config: duplicate worker {spec.url}")
        seen.add(spec.url)
    return specs


def read_worker_file(path: str) -> list[WorkerSpec]:
    """Parse a worker file: a list (or {"workers": list}) of URLs or {url, model, capabilities}."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"worker_config: cannot read {path}: {exc.strerror}") from None
    try:
        if path.endswith(".json"):
            data = json.loads(text)
        else:
            import yaml  # only when a YAML worker file is used

            data = yaml.safe_load(text)
    except Exception as exc:  # json and yaml raise different error types
        raise ValueError(f"worker_config: {path} is not valid JSON/YAML: {exc}") from None
    if isinstance(data, dict) and set(data) == {"workers"}:
        data = data["workers"]
    if not isinstance(data, list):
        raise ValueError(f"worker_config: {path} must hold a list of workers")
    return [worker_spec_from_dict(entry, field="worker_config") for entry in data]


def worker_spec_from_dict(entry: object, field: str = "worker") -> WorkerSpec:
    """Build a WorkerSpec from a URL string or a {url, model, capabilities, role,
    bootstrap_port} mapping."""
    if isinstance(entry, str):
        return WorkerSpec(url=normalize_worker_url(entry, field))
    if not isinstance(entry, dict):
        raise ValueError(
            f"{field}: each worker must be a URL or a mapping, got {short_repr(entry)}"
        )
    unknown = set(entry) - _WORKER_KEYS
    if unknown:
        names = short_repr(sorted(map(str, unknown)))
        raise ValueError(
            f"{field}: unknown worker keys {names} (url, model, capabilities, role, bootstrap_port)"
        )
    if "url" not in entry:
        raise ValueError(f"{field}: worker entry {short_repr(entry)} has no url")
    model = entry.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise ValueError(
            f"{field}.model: must be a non-empty string or null, got {short_repr(model)}"
        )
    if model is not None and len(model) > MAX_MODEL_NAME_LENGTH:
        raise ValueError(
            f"{field}.model: {len(model)} characters long; the limit is {MAX_MODEL_NAME_LENGTH}"
        )
    role = entry.get("role", REGULAR)
    if role not in ROLES:
        raise ValueError(f"{field}.role: must be one of {', '.join(ROLES)}, got {short_repr(role)}")
    port = entry.get("bootstrap_port")
    check_bootstrap_port(port, f"{field}.bootstrap_port")
    if port is not None and role != PREFILL:
        raise ValueError(f"{field}.bootstrap_port: only a prefill worker has one")
    return WorkerSpec(
        url=normalize_worker_url(entry["url"], f"{field}.url"),
        model=model,
        capabilities=parse_capabilities(entry.get("capabilities"), f"{field}.capabilities"),
        role=role,
        bootstrap_port=port,
    )


_WORKER_KEYS = frozenset({"url", "model", "capabilities", "role", "bootstrap_port"})


def check_role(spec: WorkerSpec, is_pd: bool, field: str = "worker") -> None:
    """A PD router routes to prefill and decode workers only; a regular one to replicas only."""
    if is_pd and spec.role == REGULAR:
        raise ValueError(
            f"{field}.role: worker {spec.url} needs a role, prefill or decode (the router runs "
            "with --pd-disaggregation)"
        )
    if not is_pd and spec.role != REGULAR:
        raise ValueError(
            f"{field}.role: worker {spec.url} is a {spec.role} worker; start the router with "
            "--pd-disaggregation to route to prefill and decode workers"
        )


def check_bootstrap_port(port: object, field: str) -> None:
    """None (not given: asked of the worker) or a TCP port number."""
    if port is None:
        return
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(
            f"{field}: bootstrap port must be a number from 1 to 65535 (or none), got {short_repr(port)}"
        )


def parse_capabilities(value: object, field: str = "capabilities") -> frozenset[str] | None:
    """None stays None (everything); otherwise a list of known capability names."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{field}: must be a list of names, got {short_repr(value)}")
    if len(value) > MAX_NUM_CAPABILITIES:
        raise ValueError(
            f"{field}: {len(value)} entries; at most {MAX_NUM_CAPABILITIES}, one per capability"
        )
    unknown = set(value) - CAPABILITIES
    if unknown:
        raise ValueError(
            f"{field}: unknown capabilities {short_repr(sorted(unknown))}; known: {sorted(CAPABILITIES)}"
        )
    return frozenset(value)


_SELECTOR_FIELDS = ("selector", "prefill_selector", "decode_selector")
# Kubernetes label syntax: a name segment (also a label value) and a DNS subdomain prefix.
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def parse_selector(values: tuple[str, ...], field: str) -> tuple[tuple[str, str], ...]:
    """('app=cadence', 'tier=a,zone=b') -> (('app', 'cadence'), ('tier', 'a'), ('zone', 'b')):
    label pairs a pod must all carry. ValueError names `field` and the bad pair."""
    if isinstance(values, str) or not isinstance(values, tuple):
        raise ValueError(f"{field}: must be a list of KEY=VALUE labels, got {short_repr(values)}")
    pairs: dict[str, str] = {}
    for value in values:
        if not isinstance(value, str):
            raise ValueError(f"{field}: each label must be KEY=VALUE text, got {short_repr(value)}")
        for part in value.split(","):
            key, sep, label = part.strip().partition("=")
            if not sep or not _is_label_key(key) or not _is_label_value(label):
                raise ValueError(
                    f"{field}: {short_repr(part.strip())} is not a KEY=VALUE label (a key such as "
                    "app or example.com/role, a value of at most 63 letters, digits, '-', '_', '.')"
                )
            if pairs.get(key, label) != label:
                raise ValueError(f"{field}: label {key} is given twice, with different values")
            pairs[key] = label
    return tuple(pairs.items())


def _is_label_key(key: str) -> bool:
    prefix, slash, name = key.rpartition("/")
    if slash and not _DNS_SUBDOMAIN.fullmatch(prefix):
        return False
    return _LABEL_NAME.fullmatch(name) is not None


def _is_label_value(value: str) -> bool:
    return value == "" or _LABEL_NAME.fullmatch(value) is not None


def _is_dns_label(name: object) -> bool:
    return isinstance(name, str) and _DNS_LABEL.fullmatch(name) is not None


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field}: {message}")


def _check_key(key: str | None, field: str) -> None:
    """A key travels in an HTTP header: Latin-1 text, no control characters, no outer blanks.

    The messages never echo the key itself.
    """
    if key is None:
        return
    _check(isinstance(key, str) and bool(key), field, "must be a non-empty string")
    try:
        key.encode("latin-1")
    except UnicodeEncodeError:
        raise ValueError(
            f"{field}: must be Latin-1 text (it is sent in an HTTP header); use ASCII"
        ) from None
    _check(
        not any(ord(c) < 0x20 or ord(c) == 0x7F for c in key),
        field,
        "must not contain control characters (it is sent in an HTTP header)",
    )
    _check(key == key.strip(" \t"), field, "must not start or end with blanks (HTTP strips them)")


def short_repr(value: object, limit: int = 100) -> str:
    """repr() cut to `limit` characters, for error messages that echo user input."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"
