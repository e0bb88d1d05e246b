"""`cadence launch`'s command line and plan: which flags go to the replicas and which to the
router, the errors that name a bad flag before anything starts, the replicas' ports and
shares of the machine, and each child's own command line. No process is started."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from cadence.launch_dp import (
    LaunchArgs,
    Replica,
    _shares,
    build_parser,
    parse,
    plan_replicas,
    replica_spec,
    router_spec,
    split_argv,
)


def error_of(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_each_flag_goes_to_its_side_with_its_values():
    server, router = split_argv(
        ["--model-path", "m.gguf", "--router-policy", "cache_aware", "--dp-size", "2",
         "--router-health-check-interval-secs=0.5", "--random-seed", "-1",
         "--router-dp-worker-base-port", "32000", "--router-enable-admin-api"]
    )  # fmt: skip
    assert server == ["--model-path", "m.gguf", "--dp-size", "2", "--random-seed", "-1",
                      "--router-dp-worker-base-port", "32000"]  # fmt: skip
    assert router == ["--policy", "cache_aware", "--health-check-interval-secs=0.5",
                      "--enable-admin-api"]  # fmt: skip


def test_the_plan_reads_both_sides_as_their_own_commands_would():
    plan = parse(
        ["--port", "30100", "--dp-size", "3", "--max-total-tokens", "4096", "--skip-warmup",
         "--router-policy", "least_request", "--router-health-failure-threshold", "1"]
    )  # fmt: skip
    assert plan.launch == LaunchArgs(dp_size=3)
    assert (plan.host, plan.port) == ("127.0.0.1", 30100)
    assert plan.server.max_total_tokens == 4096 and plan.server.skip_warmup
    # The replicas' own flags: no launcher flag among them, nor the router's port.
    assert plan.server_argv == ["--max-total-tokens", "4096", "--skip-warmup"]
    assert plan.router_argv == ["--policy", "least_request", "--health-failure-threshold", "1"]


def test_a_router_port_without_a_grpc_port_above_it_is_fine():
    # `cadence serve --port 60000` needs --grpc-port (60000 + 10000 is no port); the router does not.
    assert parse(["--port", "60000", "--dp-size", "2"]).port == 60000


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--dp-size", "0"], "dp_size must be ≥ 1, got 0"),
        (["--router-bogus", "1"], "unrecognized arguments: --router-bogus"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--router-health-check-interval-secs", "x"], "--router-health-check-interval-secs"),
        (["--router-health-check-interval-secs", "0"], "health_check_interval_secs"),
        (["--router-policy", "nope"], "--router-policy"),
        (["--router-port", "9000"], "--router-port: the router listens on --host and --port"),
        (["--router-worker-urls", "http://a:1", "http://b:2"], "--router-worker-config"),
        (["--router-pd-disaggregation"], "cadence launch starts complete replicas"),
        (["--grpc-port", "40000"], "grpc_port: each replica serves gRPC on its own"),
        (["--dp-size", "2", "--kv-events-config", "{}"], "kv_events_config"),
        (["--router-dp-worker-base-port", "60000"], "router_dp_worker_base_port must be ≤ 55535"),
        (["--port", "0"], "port must be in [1, 65535]"),
        (["--router-pol", "random"], "unrecognized arguments: --router-pol"),  # no abbreviations
    ],
)
def test_a_bad_flag_is_refused_naming_it(argv, names, capsys):
    err = error_of(argv, capsys)
    assert "cadence launch: error:" in err and names in err, err


def test_help_lists_the_servers_the_launchers_and_the_routers_flags():
    text = build_parser().format_help()
    for flag in ("--model-path", "--dp-size", "--router-dp-worker-base-port", "--router-policy",
                 "--router-health-check-interval-secs", "--router-api-key"):  # fmt: skip
        assert flag in text
    assert "--router-port" not in text and "--router-worker-urls" not in text


def test_replicas_take_free_ports_from_the_base_up_and_skip_taken_ones():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        base = sock.getsockname()[1]
        if base + 2 + 10000 > 65535:
            pytest.skip("the OS gave a port too high to leave room for gRPC ports")
        # `base` itself is taken (held by `sock`): the replicas start above it.
        plan = parse(["--port", str(base), "--dp-size", "2",
                      "--router-dp-worker-base-port", str(base)])  # fmt: skip
        with pytest.raises(ValueError, match=r"^port: .* is in use; the router listens there"):
            plan_replicas(plan)
    plan = parse(["--port", str(base), "--dp-size", "2", "--router-dp-worker-base-port",
                  str(base)])  # fmt: skip
    with socket.socket() as sock:  # hold base + 1: it is skipped
        sock.bind(("127.0.0.1", base + 1))
        replicas = plan_replicas(plan)
    ports = [(r.port, r.grpc_port) for r in replicas]
    assert ports[0][0] > base + 1 and ports[1][0] > ports[0][0]  # never the router's port
    assert all(grpc == port + 10000 for port, grpc in ports)
    assert [r.url for r in replicas] == [f"http://127.0.0.1:{p}" for p, _ in ports]


def test_disable_grpc_leaves_the_replicas_without_grpc_ports():
    plan = parse(["--port", "30100", "--dp-size", "2", "--disable-grpc"])
    assert all(r.grpc_port is None for r in plan_replicas(plan))


def test_gpus_go_to_replicas_in_slices_of_their_ranks(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert _shares(2, 1)[1] == ["0", "1"]  # one device each, from the first, as SGLang
    assert _shares(2, 2)[1] == ["0,1", "2,3"]  # two ranks each
    assert _shares(3, 2)[1] == [None, None, None]  # too few: shared, as inherited
    assert _shares(1, 1)[1] == [None]  # one replica keeps what it inherits
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert _shares(2, 1)[1] == [None, None]


def test_cpu_cores_are_split_into_disjoint_slices():
    cores = sorted(os.sched_getaffinity(0))
    cpus, _ = _shares(len(cores), 1)
    if len(cores) == 1:
        assert cpus == [None]
        return
    assert [c for share in cpus for c in share] == cores  # one core each, in order
    assert _shares(len(cores) + 1, 1)[0] == [None] * (len(cores) + 1)  # more replicas: shared


def test_each_child_gets_its_own_command_line():
    plan = parse(["--port", "30100", "--dp-size", "2", "--api-key", "k1", "--skip-warmup",
                  "--router-policy", "random"])  # fmt: skip
    replicas = [
        Replica(0, 31000, 41000, "http://127.0.0.1:31000", (0,), None),
        Replica(1, 31001, None, "http://127.0.0.1:31001", None, "1"),
    ]
    spec = replica_spec(replicas[0], plan.server_argv)
    argv, cpus, devices = spec.args
    assert argv == ["--api-key", "k1", "--skip-warmup", "--port", "31000", "--grpc-port", "41000"]
    assert (cpus, devices, spec.name, spec.restart) == ((0,), None, "replica 0", False)
    assert replica_spec(replicas[1], plan.server_argv).args[0][-2:] == ["--port", "31001"]
    router = router_spec(plan, replicas)
    assert router.stop_rank < spec.stop_rank  # the router stops first
    argv = router.args[0]
    assert argv[:2] == ["--policy", "random"]
    assert argv[argv.index("--port") + 1] == "30100"
    assert argv[argv.index("--worker-urls") + 1 :][:2] == [r.url for r in replicas]
    assert argv[argv.index("--api-key") + 1] == "k1"  # one key for the whole deployment
    plan = parse(["--api-key", "k1", "--router-api-key=k2"])
    assert "--api-key" not in router_spec(plan, replicas).args[0]


def test_the_launcher_and_its_router_child_start_without_torch():
    # The launcher only plans and watches; the router child imports replica_set first.
    probe = (
        "import sys\n"
        "from cadence.launch_dp import parse, plan_replicas\n"
        "import cadence.replica_set\n"
        "plan_replicas(parse(['--port', '30100', '--dp-size', '2']))\n"
        "print(sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
    done = subprocess.run([sys.executable, "-m", "cadence.cli", "launch", "--help"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0 and "--router-policy" in done.stdout


def test_sglangs_data_parallel_size_spelling_never_reaches_a_replica():
    """A replica that got --data-parallel-size 2 would start replicas of its own."""
    plan = parse(["--data-parallel-size", "2", "--tensor-parallel-size", "1", "--skip-warmup"])
    assert plan.launch.dp_size == 2 and plan.server.dp_size == 2
    assert plan.server_argv == ["--tensor-parallel-size", "1", "--skip-warmup"]


def test_cadence_serve_with_dp_size_hands_its_whole_line_to_the_launcher(monkeypatch):
    """`cadence serve --dp-size 2` (SGLang's launch line) is served as `cadence launch`;
    --dp-size 1 is an ordinary server."""
    import cadence.launch_server

    handed: list[list[str]] = []

    def execv(path, argv):  # the launcher takes the process over: nothing after it runs
        handed.append(argv)
        raise SystemExit(0)

    monkeypatch.setattr(os, "execv", execv)
    launched: list = []
    monkeypatch.setattr(cadence.launch_server, "launch", lambda args: launched.append(args) or 0)
    monkeypatch.setattr(cadence.launch_server, "exit_now", lambda code: code)
    argv = ["--dp-size", "2", "--skip-warmup", "--port", "30500", "--router-policy", "random"]
    with pytest.raises(SystemExit):
        cadence.launch_server.main(argv)
    assert handed == [[sys.executable, "-m", "cadence.launch_dp", *argv]] and not launched
    cadence.launch_server.main(["--dp-size", "1", "--skip-warmup"])  # ends in exit_now(launch())
    assert len(handed) == 1 and launched[0].dp_size == 1


def test_the_in_process_engine_refuses_data_parallelism():
    from cadence.engine import Engine

    with pytest.raises(ValueError, match="dp_size: the in-process Engine is one replica"):
        Engine(dp_size=2)
