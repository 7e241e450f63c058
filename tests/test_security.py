"""TLS, mutual TLS and bearer-token auth against real servers.

Certificates are generated here at run time (a throwaway CA, a server certificate for
127.0.0.1, a client certificate); nothing secret is stored in the repository.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from openenv_grpc import AsyncSession, SessionRefused, VectorSession, fetch_info
from openenv_grpc.client.channel import tls_credentials
from openenv_grpc.client.errors import InfoUnavailable
from openenv_grpc_envs.echo import EchoAction, EchoEnv

TOKEN = "correct horse battery staple"


def tls_server(start_server, pki: Path, *extra: str):  # type: ignore[no-untyped-def]
    return start_server(
        "support.envs:CountingEchoEnv",
        "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"), *extra,
    )  # fmt: skip


def test_tls_session_round_trip(start_server, pki: Path) -> None:
    server = tls_server(start_server, pki)
    credentials = tls_credentials(ca=pki / "ca.pem")
    with EchoEnv(server.target, credentials=credentials) as env:
        env.reset()
        assert env.step(EchoAction(message="over tls")).observation.echoed_message == "over tls"
    assert fetch_info(server.target, credentials=credentials).env_name == "echo"


def test_plaintext_client_cannot_talk_to_a_tls_server(start_server, pki: Path) -> None:
    server = tls_server(start_server, pki)
    with pytest.raises(SessionRefused) as refused:
        EchoEnv(server.target).open()
    assert refused.value.code is grpc.StatusCode.UNAVAILABLE
    assert server.created() == 0


def test_mutual_tls_requires_a_client_certificate_from_the_ca(start_server, pki: Path) -> None:
    server = tls_server(start_server, pki, "--tls-client-ca", str(pki / "ca.pem"))
    good = tls_credentials(pki / "ca.pem", pki / "client.pem", pki / "client.key")
    with EchoEnv(server.target, credentials=good) as env:
        assert env.reset().observation.echoed_message == "ready"
    for credentials in (
        tls_credentials(pki / "ca.pem"),  # no client certificate at all
        tls_credentials(pki / "ca.pem", pki / "rogue-client.pem", pki / "rogue-client.key"),
    ):
        with pytest.raises(SessionRefused) as refused:
            EchoEnv(server.target, credentials=credentials).open()
        assert refused.value.code is grpc.StatusCode.UNAVAILABLE
    assert server.created() == 1  # only the trusted client got an env


def test_tls_setting_without_key_fails_at_start(tmp_path: Path, pki: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "openenv_grpc", "serve", "echo", "--port", "0",
         "--tls-cert", str(pki / "server.pem")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 1
    assert "TLS needs both TLS_CERT and TLS_KEY" in run.stderr


@pytest.fixture
def token_server(start_server):  # type: ignore[no-untyped-def]
    return start_server("support.envs:CountingEchoEnv", extra_env={"AUTH_TOKEN": TOKEN})


def test_token_auth_admits_the_right_token(token_server) -> None:
    with EchoEnv(token_server.target, token=TOKEN) as env:
        env.reset()
        assert env.step(EchoAction(message="hi")).observation.echoed_message == "hi"
    assert fetch_info(token_server.target, token=TOKEN).env_name == "echo"


@pytest.mark.parametrize("token", [None, "", "wrong", TOKEN + "x", TOKEN[:-1]])
def test_wrong_or_missing_token_is_unauthenticated_before_any_env(token_server, token) -> None:
    with pytest.raises(SessionRefused) as refused:
        EchoEnv(token_server.target, token=token).open()
    assert refused.value.code is grpc.StatusCode.UNAUTHENTICATED
    assert refused.value.message == "missing or invalid bearer token"
    with pytest.raises(InfoUnavailable) as info_refused:
        fetch_info(token_server.target, token=token)
    assert info_refused.value.code is grpc.StatusCode.UNAUTHENTICATED
    assert token_server.created() == 0
    assert fetch_info(token_server.target, token=TOKEN).capacity.active_sessions == 0


def test_a_vector_open_without_the_token_is_unauthenticated_before_any_env(
    token_server,
) -> None:
    with pytest.raises(SessionRefused) as refused:
        VectorSession(token_server.target, 3).open()
    assert refused.value.code is grpc.StatusCode.UNAUTHENTICATED
    assert refused.value.message == "missing or invalid bearer token"
    assert token_server.created() == 0
    with VectorSession(token_server.target, 3, token=TOKEN) as envs:
        assert envs.reset().indices == [0, 1, 2]
    token_server.wait_until(lambda: token_server.closed_envs() == 3)


def test_health_is_exempt_from_token_auth(token_server) -> None:
    assert token_server.health() == health_pb2.HealthCheckResponse.SERVING


def test_async_session_sends_the_token(token_server) -> None:
    async def main() -> str:
        async with AsyncSession(token_server.target, token=TOKEN) as env:
            await env.reset()
            return (await env.step(EchoAction(message="async"))).observation.echoed_message

    assert asyncio.run(main()) == "async"


# -- clients never fall back to plaintext -------------------------------------------------


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "openenv_grpc", *args],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_cli_info_with_any_tls_option_speaks_tls_or_fails(start_server, pki: Path) -> None:
    """`--cert/--key` without `--ca` once meant plaintext: now any TLS option means TLS."""
    plain = start_server("support.envs:CountingEchoEnv")
    mutual = tls_server(start_server, pki, "--tls-client-ca", str(pki / "ca.pem"))
    client = ["--cert", str(pki / "client.pem"), "--key", str(pki / "client.key")]
    # Against a plaintext server, TLS fails loudly (it did succeed over plaintext before).
    run = cli("info", plain.target, *client, "--timeout", "3")
    assert run.returncode == 1, run.stdout
    assert "UNAVAILABLE" in run.stderr or "DEADLINE_EXCEEDED" in run.stderr
    # The system roots do not trust the test CA: TLS was attempted, and it failed.
    run = cli("info", mutual.target, *client, "--timeout", "3")
    assert run.returncode == 1
    # With the CA as well, the same options reach the mutual-TLS server.
    run = cli("info", mutual.target, "--ca", str(pki / "ca.pem"), *client)
    assert run.returncode == 0, run.stderr
    assert '"env_name": "echo"' in run.stdout
    # Half a client certificate is refused before any connection.
    for half in (["--cert", str(pki / "client.pem")], ["--key", str(pki / "client.key")]):
        run = cli("info", plain.target, *half)
        assert run.returncode == 2
        assert "--cert and --key go together" in run.stderr


def test_console_with_tls_options_never_uses_plaintext(start_server, pki: Path) -> None:
    plain = start_server("support.envs:CountingEchoEnv")
    client = ["--cert", str(pki / "client.pem"), "--key", str(pki / "client.key")]
    run = cli("console", plain.target, *client, "--port", "0", "--connect-timeout", "3")
    assert run.returncode == 1, run.stdout
    assert "UNAVAILABLE" in run.stderr or "DEADLINE_EXCEEDED" in run.stderr
    run = cli("console", plain.target, "--cert", str(pki / "client.pem"), "--port", "0")
    assert run.returncode == 2
    assert "--cert and --key go together" in run.stderr


def test_provider_with_credentials_speaks_tls_to_its_server(pki: Path) -> None:
    from openenv_grpc.providers import LocalProcessProvider
    from openenv_grpc_envs.echo import AsyncEchoEnv

    flags = ["--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key")]
    credentials = tls_credentials(ca=pki / "ca.pem")
    with LocalProcessProvider("echo", args=flags, grace=1, credentials=credentials) as provider:
        # start() waited for health SERVING over TLS; the provider's channel is TLS too.
        with provider.session(EchoEnv) as env:
            env.reset()
            assert env.step(EchoAction(message="tls")).observation.echoed_message == "tls"

        async def rollout() -> str:
            async with provider.session(AsyncEchoEnv) as env:  # owns a TLS channel
                await env.reset()
                return (await env.step(EchoAction(message="aio"))).observation.echoed_message

        assert asyncio.run(rollout()) == "aio"


def test_provider_with_credentials_fails_loudly_on_a_plaintext_server(pki: Path) -> None:
    from openenv_grpc.providers import LocalProcessProvider, ProviderError

    credentials = tls_credentials(ca=pki / "ca.pem")
    provider = LocalProcessProvider("echo", credentials=credentials, start_timeout=5)
    with pytest.raises(ProviderError, match="not SERVING"):
        provider.start()
    assert not provider.running()
