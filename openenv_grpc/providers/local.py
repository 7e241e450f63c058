"""``LocalProcessProvider``: ``openenv-grpc serve ENV`` as a child process, no Docker.

The child listens on a free loopback port (``--port 0``); the provider reads the port from
the line the server prints when it is up, waits for ``grpc.health.v1`` SERVING, and on
:meth:`stop` sends SIGTERM (the server drains: NOT_SERVING, sessions get their grace
period, every env is closed) and kills it if it has not exited in time.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import tempfile
import threading
import weakref
from collections.abc import Mapping, Sequence

import grpc

from openenv_grpc.metadata import SERVICE_NAME, SERVING_LINE
from openenv_grpc.providers.base import Provider, ProviderError, wait_serving

__all__ = ["LocalProcessProvider"]


#: Providers with a live child; the interpreter's exit stops them (no orphan servers).
_LIVE: weakref.WeakSet[LocalProcessProvider] = weakref.WeakSet()


@atexit.register
def _stop_leftovers() -> None:
    for provider in list(_LIVE):
        provider.stop()


class LocalProcessProvider(Provider):
    """One ``openenv-grpc serve`` child process on this machine.

    Args:
        env: What ``serve`` gets: a packaged env name or ``module:factory``.
        args: More ``serve`` flags, e.g. ``["--idle-timeout", "30"]``.
        host: Listen address; loopback by default.
        max_concurrent_envs: ``--max-concurrent-envs`` (None: the server's default).
        grace: ``--grace`` seconds for the drain on stop (None: the server's default, 25).
        extra_env: Environment variables added to this process's for the child.
        python: The interpreter that runs the server.
        start_timeout: Seconds to wait for the port line and then for SERVING.
        stop_timeout: Seconds :meth:`stop` waits after SIGTERM before it kills; default
            ``grace + 5`` (the drain may use the whole grace period).
        health_service: The health service that must be SERVING (the env service: it is
            the one that goes NOT_SERVING on drain).
    """

    def __init__(
        self,
        env: str = "echo",
        *,
        args: Sequence[str] = (),
        host: str = "127.0.0.1",
        max_concurrent_envs: int | None = None,
        grace: float | None = None,
        extra_env: Mapping[str, str] | None = None,
        python: str = sys.executable,
        start_timeout: float = 60.0,
        stop_timeout: float | None = None,
        health_service: str = SERVICE_NAME,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        super().__init__(credentials=credentials)
        self.env = env
        flags = ["--host", host, "--port", "0"]
        if max_concurrent_envs is not None:
            flags += ["--max-concurrent-envs", str(max_concurrent_envs)]
        if grace is not None:
            flags += ["--grace", str(grace)]
        self.command = [python, "-m", "openenv_grpc", "serve", env, *flags, *args]
        self.extra_env = dict(extra_env or {})
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout if stop_timeout is not None else (grace or 25.0) + 5.0
        self.health_service = health_service
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0
        self._host = host
        #: Every line the server printed on stdout.
        self.stdout_lines: list[str] = []
        self._announced = threading.Event()
        self._stderr: tempfile._TemporaryFileWrapper[str] | None = None

    @property
    def target(self) -> str:
        """``host:port`` of the running server.

        Raises:
            ProviderError: not started.
        """
        if not self.port:
            raise ProviderError("the provider has not been started")
        host = "127.0.0.1" if self._host in ("0.0.0.0", "") else self._host
        return f"{host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The child's process id (None before start)."""
        return self.proc.pid if self.proc is not None else None

    def running(self) -> bool:
        """True while the child process runs."""
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Start the child, read its port, wait for SERVING.

        Raises:
            ProviderError: the child exited, printed no port or was not healthy within
                ``start_timeout`` (it is killed then, with its stderr in the message).
            RuntimeError: already started.
        """
        if self.proc is not None:
            raise RuntimeError("the provider is already started")
        # Lives as long as the child; closed by stop().
        self._stderr = tempfile.NamedTemporaryFile(  # noqa: SIM115
            mode="w+", prefix="openenv-grpc-", suffix=".stderr"
        )
        self.proc = subprocess.Popen(
            self.command,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **self.extra_env},
            text=True,
        )
        _LIVE.add(self)
        threading.Thread(target=self._read_stdout, args=(self.proc,), daemon=True).start()
        try:
            if not self._announced.wait(self.start_timeout) or not self.port:
                raise ProviderError(f"{self.env!r} printed no port in {self.start_timeout}s")
            wait_serving(
                self.target,
                self.health_service,
                self.start_timeout,
                self.running,
                credentials=self.credentials,
            )
        except BaseException as exc:  # includes KeyboardInterrupt: never leave the child
            output = self.stderr()
            self.stop()
            if isinstance(exc, ProviderError):
                raise ProviderError(f"{exc}; server stderr:\n{output[-4000:]}") from None
            raise

    def _read_stdout(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.stdout_lines.append(line)
            match = SERVING_LINE.search(line)
            if match and not self.port:
                self.port = int(match.group(3))
                self._announced.set()
        proc.stdout.close()
        self._announced.set()  # the process ended: stop waiting

    def stderr(self) -> str:
        """Everything the server wrote to stderr so far ("" once stopped)."""
        if self._stderr is None or self._stderr.closed:
            return ""
        self._stderr.flush()
        self._stderr.seek(0)
        return self._stderr.read()

    def terminate(self) -> None:
        """Send SIGTERM (start the drain) without waiting."""
        if self.running():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the child at once (its sessions end as the network sees it)."""
        if self.running():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait()

    def _stop_servers(self) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._stderr is not None:
            self._stderr.close()
        _LIVE.discard(self)

    @property
    def returncode(self) -> int | None:
        """The child's exit code once it has ended (None while it runs)."""
        return self.proc.poll() if self.proc is not None else None
