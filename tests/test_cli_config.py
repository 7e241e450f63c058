"""ServerConfig.from_env, and the ``openenv-grpc`` command run as a real process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from openenv_grpc import ServerConfig
from openenv_grpc.server.config import ENV_VARS
from openenv_grpc_envs.echo import EchoAction, EchoEnv

TESTS = Path(__file__).resolve().parent


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 30.0):  # type: ignore[no-untyped-def]
    return subprocess.run(
        [sys.executable, "-m", "openenv_grpc", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


# -- ServerConfig.from_env --------------------------------------------------------------


def test_from_env_defaults_with_empty_environ() -> None:
    assert ServerConfig.from_env({}) == ServerConfig()
    config = ServerConfig.from_env({})
    assert (config.max_concurrent_envs, config.idle_timeout, config.grace_period) == (
        1024,
        600.0,
        25.0,
    )
    assert config.retry_pushback_ms == 500


def test_from_env_parses_every_variable() -> None:
    environ = {
        "HOST": "0.0.0.0",
        "PORT": "6000",
        "MAX_CONCURRENT_ENVS": "7",
        "MAX_VECTOR_ENVS": "16",
        "MAX_VECTOR_IN_FLIGHT": "3",
        "IDLE_TIMEOUT": "1.5",
        "GRACE_PERIOD": "3",
        "MAX_MESSAGE_BYTES": "1024",
        "MAX_REQUEST_BYTES": "512",
        "ENV_THREADS": "2",
        "LIFECYCLE_TIMEOUT": "7.5",
        "REQUEST_ARRIVAL_TIMEOUT": "3.5",
        "INLINE_THRESHOLD_MS": "0.25",
        "RETRY_PUSHBACK_MS": "250",
        "KEEPALIVE_TIME": "4.5",
        "KEEPALIVE_TIMEOUT": "0.5",
        "HANDSHAKE_TIMEOUT": "1.5",
        "MAX_CONNECTIONS": "900",
        "STEP_TIMEOUT": "2.5",
        "AUTH_TOKEN": "s3cret",
        "TLS_CERT": "/certs/server.pem",
        "TLS_KEY": "/certs/server.key",
        "TLS_CLIENT_CA": "/certs/ca.pem",
        "METRICS_PORT": "9100",
        "METRICS_HOST": "0.0.0.0",
        "METRICS_TOKEN": "scrape",
        "MAX_STREAMS_PER_CONNECTION": "64",
        "MAX_PENDING_CALLS": "5000",
        "WORKERS": "3",
        "ISOLATED": "2",
        "MAX_ENV_BYTES": "1048576",
        "REUSE_PORT": "1",
        "LOG_LEVEL": "debug",
        "LOG_FORMAT": "json",
        "MAX_SNAPSHOT_BYTES": "4096",
        "MAX_HELD_BYTES": "2097152",
        "OUTSIDER_HELD_BYTES": "1048576",
        "SNAPSHOT_KEYS": "k1:0123456789abcdef",
        "SNAPSHOT_KEYS_FILE": "/keys/snapshots",
    }
    assert set(environ) == set(ENV_VARS.values())
    config = ServerConfig.from_env(environ)
    assert config == ServerConfig(
        host="0.0.0.0",
        port=6000,
        max_concurrent_envs=7,
        max_vector_envs=16,
        max_vector_in_flight=3,
        idle_timeout=1.5,
        grace_period=3.0,
        max_message_bytes=1024,
        max_request_bytes=512,
        env_threads=2,
        lifecycle_timeout=7.5,
        request_arrival_timeout=3.5,
        inline_threshold_ms=0.25,
        retry_pushback_ms=250,
        keepalive_time=4.5,
        keepalive_timeout=0.5,
        handshake_timeout=1.5,
        max_connections=900,
        step_timeout=2.5,
        auth_token="s3cret",
        tls_cert="/certs/server.pem",
        tls_key="/certs/server.key",
        tls_client_ca="/certs/ca.pem",
        metrics_port=9100,
        metrics_host="0.0.0.0",
        metrics_token="scrape",
        max_streams_per_connection=64,
        max_pending_calls=5000,
        workers=3,
        isolated=2,
        max_env_bytes=1048576,
        reuse_port=1,
        log_level="debug",
        log_format="json",
        max_snapshot_bytes=4096,
        max_held_bytes=2097152,
        outsider_held_bytes=1048576,
        snapshot_keys="k1:0123456789abcdef",
        snapshot_keys_file="/keys/snapshots",
    )
    assert isinstance(config.port, int) and isinstance(config.grace_period, float)


def test_from_env_strips_whitespace_and_ignores_blank_values() -> None:
    config = ServerConfig.from_env({"MAX_CONCURRENT_ENVS": " 9 ", "IDLE_TIMEOUT": "   "})
    assert config.max_concurrent_envs == 9
    assert config.idle_timeout == ServerConfig().idle_timeout


def test_from_env_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAX_CONCURRENT_ENVS", "11")
    monkeypatch.setenv("GRACE_PERIOD", "0")
    config = ServerConfig.from_env()
    assert config.max_concurrent_envs == 11
    assert config.grace_period == 0.0


def test_from_env_overrides_win_over_environment() -> None:
    config = ServerConfig.from_env(
        {"MAX_CONCURRENT_ENVS": "7", "PORT": "6000"}, max_concurrent_envs=2, port=0
    )
    assert config.max_concurrent_envs == 2
    assert config.port == 0


def test_from_env_none_overrides_are_ignored() -> None:
    config = ServerConfig.from_env(
        {"MAX_CONCURRENT_ENVS": "7"}, max_concurrent_envs=None, idle_timeout=None
    )
    assert config.max_concurrent_envs == 7
    assert config.idle_timeout == ServerConfig().idle_timeout


@pytest.mark.parametrize(
    ("var", "raw"),
    [
        ("MAX_CONCURRENT_ENVS", "lots"),
        ("MAX_CONCURRENT_ENVS", "1.5"),
        ("PORT", "http"),
        ("IDLE_TIMEOUT", "soon"),
        ("GRACE_PERIOD", "1s"),
        ("RETRY_PUSHBACK_MS", "0.5"),
    ],
)
def test_from_env_bad_value_raises_value_error_naming_the_variable(var: str, raw: str) -> None:
    with pytest.raises(ValueError) as bad:
        ServerConfig.from_env({var: raw})
    assert var in str(bad.value)
    assert repr(raw) in str(bad.value)


@pytest.mark.parametrize(
    ("var", "raw", "field"),
    [
        ("PORT", "70000", "port"),
        ("PORT", "-1", "port"),
        ("IDLE_TIMEOUT", "-1", "idle_timeout"),
        ("GRACE_PERIOD", "-0.5", "grace_period"),
        ("RETRY_PUSHBACK_MS", "-1", "retry_pushback_ms"),
        ("MAX_MESSAGE_BYTES", "0", "max_message_bytes"),
        ("ENV_THREADS", "0", "env_threads"),
        ("KEEPALIVE_TIME", "0", "keepalive_time"),
        ("KEEPALIVE_TIMEOUT", "-2", "keepalive_timeout"),
        ("REUSE_PORT", "2", "reuse_port"),
        ("MAX_STREAMS_PER_CONNECTION", "-1", "max_streams_per_connection"),
        ("MAX_STREAMS_PER_CONNECTION", "2147483648", "max_streams_per_connection"),
        ("MAX_PENDING_CALLS", "-5", "max_pending_calls"),
        ("MAX_VECTOR_IN_FLIGHT", "0", "max_vector_in_flight"),
        ("MAX_VECTOR_IN_FLIGHT", "1025", "max_vector_in_flight"),
        ("REQUEST_ARRIVAL_TIMEOUT", "0", "request_arrival_timeout"),
    ],
)
def test_from_env_out_of_range_is_rejected(var: str, raw: str, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ServerConfig.from_env({var: raw})


def test_out_of_range_override_is_rejected() -> None:
    with pytest.raises(ValueError, match="idle_timeout"):
        ServerConfig.from_env({}, idle_timeout=-3.0)


@pytest.mark.parametrize(
    ("environ", "streams"),
    [
        ({}, 4608),  # the pending-call limit: every open of a burst reaches the limiter
        ({"MAX_CONCURRENT_ENVS": "10"}, 4608),  # at least 4,608 (a 4,000-open burst)
        ({"MAX_CONCURRENT_ENVS": "2048"}, 8704),  # 4 x capacity + 512
        ({"MAX_CONCURRENT_ENVS": "10", "MAX_PENDING_CALLS": "1000"}, 1000),
        ({"MAX_CONCURRENT_ENVS": "10000"}, 32768),  # 4 x capacity + 512, up to 32,768
        ({"MAX_CONCURRENT_ENVS": "10", "MAX_PENDING_CALLS": "100"}, 100),
        ({"MAX_CONCURRENT_ENVS": "40000"}, 40000 + 32),  # at least capacity + headroom
        ({"MAX_CONCURRENT_ENVS": "0"}, 0),
        ({"MAX_CONCURRENT_ENVS": "10", "MAX_STREAMS_PER_CONNECTION": "5"}, 5),
        ({"MAX_CONCURRENT_ENVS": "0", "MAX_STREAMS_PER_CONNECTION": "100"}, 100),
    ],
)
def test_streams_per_connection_default_to_the_pending_limit_or_capacity_plus_headroom(
    environ: dict[str, str], streams: int
) -> None:
    assert ServerConfig.from_env(environ).streams_per_connection == streams


@pytest.mark.parametrize(("raw", "capacity"), [("0", 0), ("-1", 0), ("-50", 0), ("5", 5)])
def test_non_positive_max_concurrent_envs_means_unlimited(raw: str, capacity: int) -> None:
    assert ServerConfig.from_env({"MAX_CONCURRENT_ENVS": raw}).capacity == capacity


def test_address_brackets_ipv6_hosts() -> None:
    assert ServerConfig(host="::", port=5).address == "[::]:5"
    assert ServerConfig(host="127.0.0.1", port=5).address == "127.0.0.1:5"


# -- the command line ---------------------------------------------------------------------


def test_serve_unknown_env_exits_2_with_clear_message() -> None:
    done = _cli("serve", "no-such-env", "--port", "0")
    assert done.returncode == 2
    assert "no environment named 'no-such-env'" in done.stderr
    assert "echo" in done.stderr  # names the packaged envs that do exist
    assert "Traceback" not in done.stderr


def test_serve_unimportable_module_exits_2_with_clear_message() -> None:
    done = _cli("serve", "no_such_module_xyz:make", "--port", "0")
    assert done.returncode == 2
    assert "cannot import 'no_such_module_xyz'" in done.stderr
    assert "Traceback" not in done.stderr


def test_serve_bad_env_var_exits_2_naming_the_variable() -> None:
    done = _cli("serve", "echo", "--port", "0", env={"MAX_CONCURRENT_ENVS": "lots"})
    assert done.returncode == 2
    assert "MAX_CONCURRENT_ENVS='lots' is not a valid int" in done.stderr
    assert "Traceback" not in done.stderr


def test_serve_on_a_port_in_use_fails_with_clear_message() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _cli("serve", "echo", "--host", "127.0.0.1", "--port", str(port))
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "openenv-grpc: serving" not in done.stdout
    assert "Traceback" not in done.stderr


def test_info_prints_json_with_env_name_and_capacity(start_server) -> None:
    server = start_server("support.envs:CountingEchoEnv", "--max-concurrent-envs", "3")
    with EchoEnv(server.target):
        done = _cli("info", server.target)
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["env_name"] == "echo"
    assert info["capacity"] == {
        "max_sessions": 3,
        "active_sessions": 1,
        "draining": False,
        "workers": 1,
    }
    assert info["protocol"] == "openenv_grpc.v1"
    assert info["observation_type"] == "openenv_grpc_envs.echo.v1.EchoObservation"
    assert "descriptors" not in info
    assert any(name.endswith("echo.proto") for name in info["descriptor_files"])


def test_info_unreachable_target_fails_non_zero(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = _cli("info", f"127.0.0.1:{port}", "--timeout", "1")
    assert done.returncode == 1
    assert f"127.0.0.1:{port}" in done.stderr
    assert "DEADLINE_EXCEEDED" in done.stderr or "UNAVAILABLE" in done.stderr


def test_list_prints_echo() -> None:
    done = _cli("list")
    assert done.returncode == 0, done.stderr
    assert "echo" in done.stdout.split()


FACTORY_MODULE = textwrap.dedent(
    """
    from support.envs import CountingEchoEnv

    def make_env() -> CountingEchoEnv:
        return CountingEchoEnv()

    def make_unannotated():
        return CountingEchoEnv()
    """
)


@pytest.fixture
def factory_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "factories"
    directory.mkdir()
    (directory / "cli_factories.py").write_text(FACTORY_MODULE)
    return directory


def test_annotated_module_factory_is_served(start_server, factory_dir: Path) -> None:
    server = start_server("cli_factories:make_env", extra_env={"PYTHONPATH": str(factory_dir)})
    assert server.info().env_name == "echo"
    with EchoEnv(server.target) as env:
        env.reset()
        assert env.step(EchoAction(message="made")).observation.echoed_message == "made"
    server.wait_until(lambda: server.closed_envs() == 1, what="env closed")
    assert server.created() == 1


def test_unannotated_module_factory_fails_with_clear_error(factory_dir: Path) -> None:
    pythonpath = os.pathsep.join([str(factory_dir), str(TESTS), os.environ.get("PYTHONPATH", "")])
    done = _cli(
        "serve", "cli_factories:make_unannotated", "--port", "0", env={"PYTHONPATH": pythonpath}
    )
    assert done.returncode == 1
    assert "make_unannotated" in done.stderr
    assert "annotated with the Environment class it returns" in done.stderr
    assert "openenv-grpc: serving" not in done.stdout
    assert "Traceback" not in done.stderr


# -- each setting is defined once ----------------------------------------------------------


def test_settings_table_is_made_from_the_settings() -> None:
    """docs/settings.md's table is exactly what server/config.py renders (make settings-table)."""
    done = subprocess.run(
        [sys.executable, str(TESTS.parent / "scripts" / "settings_table.py"), "--check"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_setting_has_a_variable_and_all_but_secrets_a_flag() -> None:
    from openenv_grpc.server.config import settings

    names = set()
    for name, _, meta, _ in settings():
        assert meta.variable == meta.variable.upper() and meta.help
        assert (meta.flag is None) == meta.secret, name
        names.add(meta.variable)
    assert len(names) == len(settings())
    # Every flag is one of serve's options, with the setting's variable in its help.
    done = _cli("serve", "--help")
    for _, _, meta, _ in settings():
        if meta.flag:
            assert meta.flag in done.stdout
    assert "AUTH_TOKEN" in done.stdout  # named in the description, never an option
    assert "--auth-token" not in done.stdout
