"""What user code sees of OpenEnv's web UI names, printed one fact per line, so that a
process where ``serve --openenv`` deferred the UI can be compared with one where OpenEnv
imported it as usual (tests/test_openenv_web_ui.py).

``python -m support.openenv_web_ui_probe [no-gradio]``; OPENENV_GRPC_LAZY_WEB_UI=1 defers.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading

if sys.argv[1:] == ["no-gradio"]:
    sys.modules["gradio"] = None  # type: ignore[assignment]  # as if it were not installed

WEB = "openenv.core.env_server.web_interface"
read_during_import: list[str] = []


class _ReadsWhileTheUIImports:
    """An import hook that reads a lazy name while the web interface itself imports
    (when it imports gradio): as eagerly, the name is not there yet."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "gradio" and WEB in sys.modules and not read_during_import:
            package = sys.modules["openenv.core.env_server"]
            try:
                read_during_import.append(package.WebInterfaceManager.__name__)
            except AttributeError:
                read_during_import.append("AttributeError")


if sys.argv[1:] == ["during-import"]:
    sys.meta_path.insert(0, _ReadsWhileTheUIImports())  # type: ignore[arg-type]

from openenv_grpc.integrations.openenv_web_ui import leave_out_in_servers  # noqa: E402

leave_out_in_servers()

import openenv.core as core  # noqa: E402
import openenv.core.env_server as env_server  # noqa: E402


def fact(name: str, value: object) -> None:
    print(f"{name}: {value}", flush=True)


# Printed first: only this line may differ between the two processes.
fact("loaded before use", "gradio" in sys.modules)
fact("listed by dir", {"WebInterfaceManager", "create_web_interface_app"} <= set(dir(env_server)))
if sys.argv[1:] == ["dotted"]:  # the first use: the submodule through its package
    fact("dotted", env_server.web_interface.WebInterfaceManager.__name__)
    fact("its imports", (env_server.gradio_ui.__name__, env_server.gradio_theme.__name__))
    fact("then in the package's dict", "WebInterfaceManager" in vars(env_server))
    sys.exit()
if sys.argv[1:] == ["during-import"]:
    fact("first use", env_server.WebInterfaceManager.__name__)
    fact("read during its import", read_during_import)
    fact("then", (core.WebInterfaceManager.__name__, env_server.create_web_interface_app.__name__))
    sys.exit()
if sys.argv[1:] == ["no-gradio"]:
    fact("hasattr", hasattr(env_server, "WebInterfaceManager"))
    from openenv.core.env_server import WebInterfaceManager, create_web_interface_app

    fact("names without gradio", (create_web_interface_app, WebInterfaceManager))
    fact("core's names", (core.create_web_interface_app, core.WebInterfaceManager))
    try:
        importlib.import_module(WEB)
    except ImportError as exc:
        fact("importing the module", type(exc).__name__)
    sys.exit()

seen: list[object] = []
threads = [
    threading.Thread(target=lambda: seen.append(env_server.WebInterfaceManager)) for _ in range(16)
]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
web = importlib.import_module(WEB)
fact("16 threads at once get the real class", all(one is web.WebInterfaceManager for one in seen))
fact("hasattr", hasattr(env_server, "WebInterfaceManager"))
from openenv.core.env_server import WebInterfaceManager, create_web_interface_app  # noqa: E402

fact("from-import gives the real objects", (
    WebInterfaceManager is web.WebInterfaceManager,
    create_web_interface_app is web.create_web_interface_app,
))  # fmt: skip
fact("through openenv.core", (
    core.WebInterfaceManager is web.WebInterfaceManager,
    core.create_web_interface_app is web.create_web_interface_app,
))  # fmt: skip


class Mine(WebInterfaceManager):  # type: ignore[misc,valid-type]
    pass


fact("a subclass is OpenEnv's", issubclass(Mine, web.WebInterfaceManager))
fact("the manager's module", WebInterfaceManager.__module__)
import openenv.core.env_server.web_interface as aliased  # noqa: E402

fact("import ... as", (aliased is web, env_server.web_interface is web))
fact("its spec", (web.__spec__.name, web.__spec__.origin.rsplit("/", 3)[-3:]))
fact("find_spec", importlib.util.find_spec(WEB).origin == web.__spec__.origin)
star: dict[str, object] = {}
exec("from openenv.core.env_server import *", star)
fact("import *", star["WebInterfaceManager"] is web.WebInterfaceManager)
star = {}
exec("from openenv.core import *", star)
fact("openenv.core import *", star["create_web_interface_app"] is web.create_web_interface_app)
fact("other names still fail", (hasattr(env_server, "no_such_name"), hasattr(core, "no_such")))
fact("openenv.core's own lazy names", core.EnvClient.__name__)
fact("in each module's dict after use", (
    vars(env_server)["create_web_interface_app"] is web.create_web_interface_app,
    vars(core)["WebInterfaceManager"] is web.WebInterfaceManager,
))  # fmt: skip
fact("module hooks after use", ("__getattr__" in vars(env_server), "__dir__" in vars(core)))
fact("dir after use", sorted(dir(env_server)) == sorted(vars(env_server)))
fact("the UI's own imports", (env_server.gradio_ui.__name__, env_server.gradio_theme.__name__))
mine = object()
env_server.create_web_interface_app = mine  # type: ignore[attr-defined]
fact("a patched name stays patched", env_server.create_web_interface_app is mine)
del env_server.create_web_interface_app
fact("a deleted name is gone", not hasattr(env_server, "create_web_interface_app"))
fact("reload", importlib.reload(env_server).WebInterfaceManager is web.WebInterfaceManager)
