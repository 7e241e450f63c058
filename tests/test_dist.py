"""``make dist``'s wheel and sdist work without a checkout: built from this tree (the
wheel from the unpacked sdist, as ``python -m build`` does), the wheel with its
``[gymnasium]`` extra installed into a fresh venv (no system site-packages, dependencies
from the package index), then ``openenv-grpc serve echo`` and ``serve gymnasium`` run
from that venv, in a folder outside the checkout, and a client from that venv steps both
(the typed echo client, and ``gymnasium.make("<module>:openenv-grpc/CartPole-v1")``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tarfile
import threading
import venv
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from openenv_grpc.metadata import SERVING_LINE

# A fresh venv and the index: heavy, so `make test` (not test-fast) runs it.
pytestmark = [pytest.mark.slow, pytest.mark.fresh_server, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parent.parent

#: What a wheel must hold beyond the library's modules: the catalogue under its import
#: name, the generated code, and the data files the envs, console and scaffold read.
WHEEL_MUST_HOLD = [
    "openenv_grpc/v1/session_pb2.py",
    "openenv_grpc/py.typed",
    "openenv_grpc/console/static/index.html",
    "openenv_grpc/scaffold/templates/environment.py.tmpl",
    "openenv_grpc_envs/echo/v1/echo_pb2.py",
    "openenv_grpc_envs/gymnasium/adapters/registration.py",
    "openenv_grpc_envs/gymnasium/v1/gymnasium_pb2.py",
    "openenv_grpc_envs/wordle/answers.txt",
    "openenv_grpc_envs/coding/v1/coding_pb2.py",
    "openenv_grpc_envs/openspiel/v1/openspiel_pb2.py",
]

#: The client run from the wheel's venv: it checks that it imports nothing from a checkout.
CLIENT = """
import sys
import gymnasium
import openenv_grpc, openenv_grpc_envs
from openenv_grpc_envs.echo import EchoAction, EchoEnv

venv = sys.argv[1]
for module in (openenv_grpc, openenv_grpc_envs):
    assert module.__file__.startswith(venv), module.__file__
with EchoEnv(sys.argv[2]) as env:
    env.reset(seed=1)
    result = env.step(EchoAction(message="from the wheel"))
    print("echo", result.observation.echoed_message, result.reward)
env = gymnasium.make(
    "openenv_grpc_envs.gymnasium.adapters:openenv-grpc/CartPole-v1", target=sys.argv[3]
)
obs, info = env.reset(seed=0)
obs, reward, terminated, truncated, info = env.step(env.action_space.sample())
print("gymnasium", obs.shape, reward)
env.close()
"""


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel and sdist of this tree, built as ``make dist`` builds them."""
    out = tmp_path_factory.mktemp("dist")
    run = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return out


def only(folder: Path, pattern: str) -> Path:
    found = sorted(folder.glob(pattern))
    assert len(found) == 1, f"expected one {pattern} in {folder}: {found}"
    return found[0]


def test_wheel_and_sdist_hold_the_catalogue_and_generated_code(dist: Path) -> None:
    with zipfile.ZipFile(only(dist, "openenv_grpc-*-py3-none-any.whl")) as wheel:
        names = set(wheel.namelist())
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        registered = wheel.read(entry_points).decode()
    missing = [name for name in WHEEL_MUST_HOLD if name not in names]
    assert not missing, f"not in the wheel: {missing}"
    assert not [n for n in names if n.startswith(("envs/", "tests/")) or "/tests/" in n]
    for env in ("echo", "coding", "openspiel", "wordle", "gymnasium"):
        assert f"{env} = openenv_grpc_envs.{env}:" in registered
    with tarfile.open(only(dist, "openenv_grpc-*.tar.gz")) as sdist:
        members = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    for source in ("pyproject.toml", "setup.py", "envs/echo/v1/echo_pb2.py", "README.md"):
        assert source in members, f"not in the sdist: {source}"


class WheelServer:
    """``openenv-grpc serve ENV`` from the wheel's venv, run outside the checkout."""

    def __init__(self, venv_dir: Path, env: str, cwd: Path) -> None:
        self.proc = subprocess.Popen(
            [str(venv_dir / "bin" / "openenv-grpc"), "serve", env,
             "--host", "127.0.0.1", "--port", "0"],
            cwd=cwd, env=clean_environment(), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        self.output: list[str] = []
        self.port = 0
        announced = threading.Event()

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.output.append(line)
                match = SERVING_LINE.search(line)
                if match and not self.port:
                    self.port = int(match.group(3))
                    announced.set()
            announced.set()

        threading.Thread(target=read, daemon=True).start()
        if not announced.wait(120) or not self.port:
            self.stop()
            raise AssertionError(f"{env} from the wheel did not serve:\n{''.join(self.output)}")
        self.target = f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def clean_environment() -> dict[str, str]:
    """This process's environment without anything that points Python at the checkout."""
    return {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME"}}


@pytest.fixture(scope="module")
def wheel_venv(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv (no system site-packages) with ``wheel[gymnasium]`` installed."""
    folder = tmp_path_factory.mktemp("wheel-venv")
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(folder)
    wheel = only(dist, "openenv_grpc-*-py3-none-any.whl")
    run = subprocess.run(
        [str(folder / "bin" / "python"), "-m", "pip", "install", "--quiet",
         f"{wheel}[gymnasium]"],
        cwd=folder, env=clean_environment(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return folder


@pytest.fixture
def wheel_servers(wheel_venv: Path, tmp_path: Path) -> Iterator[tuple[WheelServer, ...]]:
    servers = [WheelServer(wheel_venv, env, tmp_path) for env in ("echo", "gymnasium")]
    yield tuple(servers)
    for server in servers:
        server.stop()


def test_the_wheel_alone_serves_and_steps(
    wheel_venv: Path, wheel_servers: tuple[WheelServer, ...], tmp_path: Path
) -> None:
    echo, gym = wheel_servers
    run = subprocess.run(
        [str(wheel_venv / "bin" / "python"), "-c", CLIENT, str(wheel_venv), echo.target,
         gym.target],
        cwd=tmp_path, env=clean_environment(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "echo from the wheel" in run.stdout, run.stdout
    assert re.search(r"^gymnasium \(4,\) 1\.0$", run.stdout, re.M), run.stdout
    listed = subprocess.run(
        [str(wheel_venv / "bin" / "openenv-grpc"), "list"],
        cwd=tmp_path, env=clean_environment(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    for env in ("echo", "coding", "openspiel", "wordle", "gymnasium"):
        assert env in listed.stdout, listed.stdout + listed.stderr
