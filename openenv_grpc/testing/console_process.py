"""``openenv-grpc console`` as a real child process, for tests of the web console."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

__all__ = ["ConsoleProcess"]

_LISTENING = re.compile(r"openenv-grpc console: (http://\S+/)")


class ConsoleProcess:
    """A console for the env server at ``target`` on a free loopback port; ``url`` is its
    page's address (``http://127.0.0.1:PORT/``), ``ws_base`` the same for WebSockets.

    Raises:
        RuntimeError: the console exited or did not announce its address in time.
    """

    def __init__(
        self,
        target: str,
        args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
        start_timeout: float = 30.0,
    ) -> None:
        command = [sys.executable, "-m", "openenv_grpc.cli", "console", target, "--port", "0"]
        self.process = subprocess.Popen(
            [*command, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(extra_env or {})},
        )
        self.lines: list[str] = []
        found = threading.Event()
        self.url = ""

        def pump() -> None:
            assert self.process.stdout is not None
            for line in self.process.stdout:
                self.lines.append(line.rstrip("\n"))
                match = _LISTENING.search(line)
                if match and not self.url:
                    self.url = match.group(1)
                    found.set()
            found.set()  # the process ended: stop waiting

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + start_timeout
        while not found.wait(0.1):
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"console did not start in {start_timeout}s: {self.lines}")
        if not self.url:
            self.process.wait(timeout=10)
            raise RuntimeError(f"console exited ({self.process.returncode}): {self.lines}")

    @property
    def ws_base(self) -> str:
        """``ws://127.0.0.1:PORT/``."""
        return "ws" + self.url[len("http") :]

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, then wait; returns the exit code (kills it if it hangs)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def __enter__(self) -> ConsoleProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
