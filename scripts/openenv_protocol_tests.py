"""Run OpenEnv's own protocol tests against OpenEnv's server and against ours.

    .venv/bin/python scripts/openenv_protocol_tests.py /path/to/OpenEnv [--server both]

OpenEnv's repository tests that talk to a server over the network (they start
``python -m uvicorn MODULE:app --port PORT`` and speak HTTP and WebSocket to it, or
expect one on localhost:8000) are run twice, unchanged:

- ``openenv``: as they are, OpenEnv's uvicorn (the installed ``openenv`` package);
- ``ours``: every uvicorn start swapped for ``openenv-grpc serve --openenv MODULE:app
  --openenv-port PORT --port 0`` (the bridged form), by a ``conftest.py`` this script
  writes to a temporary directory and loads as a pytest plugin (``-p``), which patches
  ``subprocess.Popen`` for uvicorn commands.

The tests built on FastAPI's in-process ``TestClient`` (production mode, MCP, simulation
mode) never open a socket: they test OpenEnv's app object itself and cannot be pointed
at another server; they are not run here. Nothing of OpenEnv is copied: the checkout's
tests and catalogue envs are read where they are.

Prints one line per server: passed, failed, skipped and the failing test ids. Exit
status 0 when ours passes every test OpenEnv's passes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

#: The network tests: test ids relative to the checkout.
TESTS = [
    "tests/envs/test_websockets.py::TestProtocolHttpEndpoints",
    "tests/envs/test_websockets.py::TestProtocolWebSocketClient",
    "tests/envs/test_websockets.py::TestConcurrencyMultipleSessions",
    "tests/envs/test_websockets.py::TestEchoEnvironment",
    "tests/envs/test_websockets.py::TestConnect4Environment",
    "tests/test_core/test_generic_client.py::TestGenericEnvClientIntegration",
]

#: The protocol tests built on FastAPI's in-process ``TestClient``: for ``ours`` each
#: ``TestClient(app)`` of an app made by OpenEnv's ``HTTPEnvServer`` becomes a real HTTP
#: and WebSocket client of ``openenv-grpc serve --openenv`` serving the same env class and
#: models (one server per env and models, shared by the run's tests).
APP_TESTS = [
    "tests/core/test_production_mode_routes.py",
    "tests/core/test_production_mode_mcp.py",
    "tests/core/test_mcp",
    "tests/core/test_simulation_mode_preserves_api.py",
]

#: The generic client's integration tests want an echo server on this port.
LOCAL_PORT = 8000

OURS = str(Path(sys.executable).with_name("openenv-grpc"))

#: The plugin making the installed openenv the one every test imports.
INSTALLED = "import openenv.core.env_server.http_server  # noqa: F401\n"

#: The plugin swapping uvicorn for ours (written to a temp dir; loaded with -p).
PLUGIN = """
import subprocess

_popen = subprocess.Popen
OURS = {ours!r}


def _swap(args):
    if not isinstance(args, (list, tuple)) or "uvicorn" not in args:
        return args
    args = list(args)
    rest = args[args.index("uvicorn") + 1:]
    target, host, port = rest[0], "127.0.0.1", "8000"
    for i, word in enumerate(rest):
        if word == "--host":
            host = rest[i + 1]
        if word == "--port":
            port = rest[i + 1]
    return [OURS, "serve", "--openenv", target, "--host", host, "--port", "0",
            "--openenv-port", port]


class SwappedPopen(_popen):
    def __init__(self, args, *rest, **kwargs):
        super().__init__(_swap(args), *rest, **kwargs)


subprocess.Popen = SwappedPopen


# -- TestClient(app) -> a real client of ours serving the app's env ---------------------
import atexit
import json
import os
import re
import sys
from pathlib import Path

import fastapi.testclient
import httpx
import starlette.testclient
from starlette.websockets import WebSocketDisconnect
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

_RealTestClient = starlette.testclient.TestClient
_SERVERS = {{}}
_SWAPPED = set()
_CURRENT = [""]


def _ref(obj):
    name = getattr(obj, "__qualname__", "")
    module = sys.modules.get(getattr(obj, "__module__", ""))
    if not name or "<" in name or module is None or not getattr(module, "__file__", None):
        return None, None
    root = Path(module.__file__).resolve().parents[len(obj.__module__.split(".")) - 1]
    return f"{{obj.__module__}}:{{name}}", str(root)


def _serve(app):
    from openenv.core.env_server.types import State
    from openenv_grpc.integrations.openenv.serving import _server_of

    server = _server_of(app, [])
    if server is None:
        return None
    refs = [_ref(server._env_factory), _ref(server.action_cls), _ref(server.observation_cls)]
    if getattr(server, "state_cls", State) is not State:
        refs.append(_ref(server.state_cls))
    if any(ref is None for ref, _ in refs):
        return None
    # An app registered in production mode has no /reset: ours is told by OPENENV_MODE.
    paths = {{getattr(route, "path", "") for route in app.routes}}
    mode = "simulation" if "/reset" in paths else "production"
    key = (*(ref for ref, _ in refs), mode)
    if key in _SERVERS:
        return _SERVERS[key][1]
    args = [OURS, "serve", "--openenv", key[0], "--action", key[1], "--observation", key[2]]
    if len(key) > 4:
        args += ["--state", key[3]]
    args += ["--host", "127.0.0.1", "--port", "0", "--openenv-port", "0"]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root for _, root in refs] + [env.get("PYTHONPATH", "")])
    env["OPENENV_MODE"] = mode
    env["MAX_CONCURRENT_ENVS"] = str(max(8, getattr(server, "_max_concurrent_envs", 8) or 8))
    process = _popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    url = None
    for line in process.stdout:
        match = re.search(r"OpenEnv protocol on (http://[^ ]+)", line)
        if match:
            url = match.group(1).strip()
            break
    if url is None:
        return None
    _SERVERS[key] = (process, url)
    return url


@atexit.register
def _stop():
    for process, _ in _SERVERS.values():
        process.terminate()


class _Socket:
    def __init__(self, url):
        self._ws = connect(url, max_size=None, open_timeout=30)

    def send_text(self, text):
        self._ws.send(text)

    def send_json(self, data, mode="text"):
        self._ws.send(json.dumps(data))

    def receive_text(self):
        try:
            return self._ws.recv(timeout=60)
        except ConnectionClosed as exc:
            raise WebSocketDisconnect(exc.rcvd.code if exc.rcvd else 1006) from None

    def receive_json(self, mode="text"):
        return json.loads(self.receive_text())

    def close(self, code=1000, reason=None):
        self._ws.close(code)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _RemoteClient(httpx.Client):
    def __init__(self, url):
        super().__init__(base_url=url, timeout=60)
        self._ws_url = url.replace("http", "ws", 1)

    def websocket_connect(self, path, *args, **kwargs):
        return _Socket(self._ws_url + path)


def TestClient(app, *args, **kwargs):
    url = _serve(app)
    if url is None:  # no HTTPEnvServer app (or an env only this process can reach)
        return _RealTestClient(app, *args, **kwargs)
    _SWAPPED.add(_CURRENT[0])
    return _RemoteClient(url)


fastapi.testclient.TestClient = TestClient
starlette.testclient.TestClient = TestClient


def pytest_runtest_setup(item):
    _CURRENT[0] = item.nodeid


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"SWAPPED {{len(_SWAPPED - {{''}})}} tests met our server")
"""


def server_command(kind: str, port: int) -> list[str]:
    """The command serving OpenEnv's echo env on ``port`` (``kind``: openenv or ours)."""
    if kind == "openenv":
        return [sys.executable, "-m", "uvicorn", "envs.echo_env.server.app:app",
                "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    return [OURS, "serve", "--openenv", "envs.echo_env.server.app:app", "--host", "127.0.0.1",
            "--port", "0", "--openenv-port", str(port)]  # fmt: skip


@contextlib.contextmanager
def local_server(kind: str, checkout: Path) -> Iterator[bool]:
    """An echo server on localhost:8000 for the generic client's integration tests;
    yields False (they skip) when the port is taken."""
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", LOCAL_PORT)) == 0:
            print(f"port {LOCAL_PORT} is taken: the generic client's tests will skip")
            yield False
            return
    process = subprocess.Popen(
        server_command(kind, LOCAL_PORT), cwd=checkout,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"http://127.0.0.1:{LOCAL_PORT}/health", timeout=1)
                break
            time.sleep(0.3)
        yield True
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run(
    kind: str, checkout: Path, tests: list[str], extra: list[str]
) -> tuple[int, int, int, list[str]]:
    """Run ``tests`` against ``kind``'s server: (passed, failed, skipped, failures)."""
    server = local_server(kind, checkout) if tests is TESTS else contextlib.nullcontext()
    with tempfile.TemporaryDirectory() as tmp, server:
        args = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
                "-p", "no:xdist", "-o", "addopts=", "--timeout", "180", *tests, *extra]  # fmt: skip
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(checkout), env.get("PYTHONPATH")]))
        # The installed openenv (0.10.0) is imported first, so the tests' own
        # sys.path.insert(0, "src") cannot swap in the checkout's copy: both runs test
        # the same OpenEnv.
        Path(tmp, "openenv_installed.py").write_text(INSTALLED)
        env["PYTHONPATH"] = os.pathsep.join([tmp, env["PYTHONPATH"]])
        args[4:4] = ["-p", "openenv_installed"]
        if kind == "ours":
            Path(tmp, "openenv_grpc_swap.py").write_text(PLUGIN.format(ours=OURS))
            args[4:4] = ["-p", "openenv_grpc_swap"]
        done = subprocess.run(args, cwd=checkout, env=env, capture_output=True, text=True)
    out = done.stdout + done.stderr
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|error)", out)}
    failures = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    swapped = re.search(r"SWAPPED (\d+) tests", out)
    if swapped:
        print(f"         ({swapped.group(1)} of them met our server through TestClient)")
    if done.returncode not in (0, 1):
        print(out[-4000:])
    return (counts.get("passed", 0), counts.get("failed", 0) + counts.get("error", 0),
            counts.get("skipped", 0), failures)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkout", type=Path, help="an OpenEnv checkout (its tests and envs)")
    parser.add_argument("--server", choices=("openenv", "ours", "both"), default="both")
    parser.add_argument("--only", choices=("network", "in-process"), help="one group of tests")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args()
    checkout = args.checkout.resolve()
    kinds = ("openenv", "ours") if args.server == "both" else (args.server,)
    results: dict[str, list[str]] = {}
    groups = (("network", TESTS), ("in-process", APP_TESTS))
    for group, tests in [g for g in groups if args.only in (None, g[0])]:
        for kind in kinds:
            passed, failed, skipped, failures = run(kind, checkout, tests, args.pytest_args)
            results.setdefault(kind, []).extend(failures)
            print(f"{group:10} {kind:8} {passed}/{passed + failed} passed, {failed} failed, "
                  f"{skipped} skipped", flush=True)  # fmt: skip
            for failure in failures:
                print(f"         FAILED {failure}", flush=True)
    if len(results) == 2:  # ours fails nothing OpenEnv's passes
        return 0 if set(results["ours"]) <= set(results["openenv"]) else 1
    return 0 if not results[kinds[0]] else 1


if __name__ == "__main__":
    sys.exit(main())
