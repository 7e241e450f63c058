"""``serve --openenv`` defers OpenEnv's Gradio web UI (openenv_grpc/integrations/
openenv_web_ui.py): the same user code, run in a process that deferred it and in one where
OpenEnv imported it as usual, sees the same objects by every route (a child process each,
tests/support/openenv_web_ui_probe.py); only whether Gradio was loaded before use differs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from openenv_grpc.integrations.openenv_web_ui import VARIABLE

TESTS = Path(__file__).resolve().parent


def _probes(*args: str) -> tuple[list[str], list[str]]:
    """The probe's facts with the UI deferred, then as OpenEnv imports it (run at once)."""
    running = []
    for lazy in ("1", ""):
        environ = {k: v for k, v in os.environ.items() if k != "ENABLE_WEB_INTERFACE"}
        environ[VARIABLE] = lazy
        environ["PYTHONPATH"] = os.pathsep.join([str(TESTS), environ.get("PYTHONPATH", "")])
        running.append(
            subprocess.Popen(
                [sys.executable, "-m", "support.openenv_web_ui_probe", *args],
                env=environ,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    out = []
    for proc in running:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr[-3000:]
        out.append(stdout.splitlines())
    return out[0], out[1]


def test_user_code_sees_openenvs_own_web_ui_objects_by_every_route() -> None:
    deferred, eager = _probes()
    assert deferred[0] == "loaded before use: False"
    assert eager[0] == "loaded before use: True"
    assert deferred[1:] == eager[1:]
    assert len(eager) == 22, eager
    assert all(": False" not in line for line in eager[1:]), eager


def test_a_name_read_while_the_ui_imports_is_not_there_yet_as_eagerly() -> None:
    deferred, eager = _probes("during-import")
    assert deferred[1:] == eager[1:]
    assert "first use: WebInterfaceManager" in eager
    assert "read during its import: ['AttributeError']" in eager


def test_the_submodule_through_its_package_is_a_first_use_too() -> None:
    deferred, eager = _probes("dotted")
    assert (deferred[0], eager[0]) == ("loaded before use: False", "loaded before use: True")
    assert deferred[1:] == eager[1:]
    assert "dotted: WebInterfaceManager" in eager


def test_enable_web_interface_imports_it_as_usual() -> None:
    probe = (
        "import sys; from openenv_grpc.integrations.openenv_web_ui import leave_out_in_servers;"
        " leave_out_in_servers(); import openenv.core.env_server;"
        " print('gradio' in sys.modules)"
    )
    environ = {**os.environ, VARIABLE: "1", "ENABLE_WEB_INTERFACE": "true"}
    done = subprocess.run(
        [sys.executable, "-c", probe], env=environ, capture_output=True, text=True, timeout=120
    )
    assert done.stdout.strip() == "True", done.stderr[-2000:]


def test_without_gradio_the_names_are_none_as_openenv_makes_them() -> None:
    deferred, eager = _probes("no-gradio")
    assert deferred == eager
    assert "names without gradio: (None, None)" in eager
    assert "importing the module: ModuleNotFoundError" in eager


def _fake_openenv(root: Path, package_init: str) -> None:
    """A stand-in OpenEnv tree: the web interface module and a package ``__init__``."""
    package = root / "openenv" / "core" / "env_server"
    package.mkdir(parents=True)
    (root / "openenv" / "__init__.py").write_text("")
    (root / "openenv" / "core" / "__init__.py").write_text("from . import env_server\n")
    (package / "__init__.py").write_text(package_init)
    (package / "web_interface.py").write_text(
        "class WebInterfaceManager:\n    pass\n\n\ndef create_web_interface_app():\n"
        "    return 'real'\n"
    )


def _import_deferred(root: Path, code: str) -> subprocess.CompletedProcess[str]:
    probe = (
        "from openenv_grpc.integrations.openenv_web_ui import leave_out_in_servers\n"
        "leave_out_in_servers()\n" + code
    )
    environ = {**os.environ, VARIABLE: "1", "PYTHONPATH": str(root)}
    environ.pop("ENABLE_WEB_INTERFACE", None)
    return subprocess.run(
        [sys.executable, "-c", probe], env=environ, capture_output=True, text=True, timeout=60
    )


def test_an_openenv_that_uses_the_names_while_importing_is_imported_whole(
    tmp_path: Path,
) -> None:
    """A version of OpenEnv that subclasses the manager in its package ``__init__`` (the
    placeholder cannot be a base class) falls back to the import OpenEnv makes itself."""
    _fake_openenv(
        tmp_path,
        "from .web_interface import WebInterfaceManager, create_web_interface_app\n\n\n"
        "class Mine(WebInterfaceManager):\n    pass\n",
    )
    done = _import_deferred(
        tmp_path,
        "import sys, openenv.core.env_server as server\n"
        "web = sys.modules['openenv.core.env_server.web_interface']\n"
        "print(server.Mine.__mro__[1] is web.WebInterfaceManager, "
        "server.create_web_interface_app())\n",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "real"]
    assert "imported it whole" in done.stderr


def test_an_openenv_that_fails_to_import_fails_as_it_would_anyway(tmp_path: Path) -> None:
    _fake_openenv(tmp_path, "raise RuntimeError('this OpenEnv is broken')\n")
    done = _import_deferred(tmp_path, "import openenv.core.env_server\n")
    assert done.returncode == 1
    assert done.stderr.strip().endswith("RuntimeError: this OpenEnv is broken"), done.stderr
    assert "imported it whole" not in done.stderr


def test_a_placeholder_that_escaped_says_so_when_called(tmp_path: Path) -> None:
    """A version of OpenEnv that keeps the name somewhere other than a module global (a
    list here): that reference cannot be made lazy, and calling it says why, by name."""
    _fake_openenv(
        tmp_path,
        "from .web_interface import WebInterfaceManager, create_web_interface_app\n"
        "KEPT = [create_web_interface_app]\n",
    )
    done = _import_deferred(
        tmp_path,
        "import openenv.core.env_server as server\n"
        "print(server.create_web_interface_app())\n"
        "server.KEPT[0]()\n",
    )
    assert done.stdout.split() == ["real"]  # the module's own name is the real one
    assert done.returncode == 1
    assert (
        "RuntimeError: create_web_interface_app was deferred by openenv-grpc and a "
        "reference to the placeholder escaped; set ENABLE_WEB_INTERFACE=true"
    ) in done.stderr
