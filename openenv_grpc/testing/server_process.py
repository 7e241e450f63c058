"""``openenv-grpc serve`` as a child process on a free loopback port, for tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from openenv_grpc.client.info import fetch_info
from openenv_grpc.metadata import SERVING_LINE
from openenv_grpc.v1 import session_pb2 as pb

__all__ = ["ServerProcess"]


class ServerProcess:
    """A real server process; ``target`` is its ``127.0.0.1:PORT``.

    Args:
        env: What ``openenv-grpc serve`` gets: a packaged env name or ``module:factory``.
        args: More ``serve`` flags, e.g. ``["--max-concurrent-envs", "2"]``.
        extra_env: Environment variables added to this process's environment.
        pythonpath: Folders prepended to PYTHONPATH (for ``module:factory`` in tests).
        start_timeout: Seconds to wait for the server to announce its port.
    """

    def __init__(
        self,
        env: str,
        args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
        pythonpath: Sequence[str | Path] = (),
        start_timeout: float = 60.0,
    ) -> None:
        environ = {**os.environ, **(extra_env or {})}
        if pythonpath:
            parts = [str(p) for p in pythonpath] + [environ.get("PYTHONPATH", "")]
            environ["PYTHONPATH"] = os.pathsep.join(p for p in parts if p)
        # Lives as long as the server; closed by stop().
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "openenv_grpc", "serve", env,
             "--host", "127.0.0.1", "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=self._stderr, env=environ, text=True,
            start_new_session=True,  # its own process group: stop() ends workers too
        )  # fmt: skip
        self.stdout_lines: list[str] = []
        self._announced = threading.Event()
        self.port = 0
        self._reader = threading.Thread(target=self._read_stdout, daemon=True)
        self._reader.start()
        if not self._announced.wait(start_timeout) or not self.port:
            output = self.stderr()
            self.stop()
            raise RuntimeError(f"server for {env!r} did not start:\n{output}")
        self.target = f"127.0.0.1:{self.port}"

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.stdout_lines.append(line)
            match = SERVING_LINE.search(line)
            if match and not self.port:
                self.port = int(match.group(3))
                self._announced.set()
        self._announced.set()  # the process ended: stop waiting

    def stderr(self) -> str:
        """Everything the server wrote to stderr so far."""
        self._stderr.flush()
        self._stderr.seek(0)
        return self._stderr.read()

    def info(self) -> pb.InfoResponse:
        return fetch_info(self.target)

    def active(self) -> int:
        """Sessions open on the server now (from the Info RPC)."""
        return self.info().capacity.active_sessions

    def health(self, service: str = "") -> int:
        """The ``grpc.health.v1`` status of ``service`` (a HealthCheckResponse enum value)."""
        with grpc.insecure_channel(self.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service=service)
            return stub.Check(request, timeout=5).status  # type: ignore[no-any-return]

    @staticmethod
    def wait_until(
        predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition"
    ) -> None:
        """Poll ``predicate`` until it holds; AssertionError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM (drain) and wait; returns the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def stop(self) -> None:
        """Kill the server if it still runs and release its files."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError):  # workers or env children left over
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._stderr.close()
