"""OpenEnv's Gradio web UI, imported by ``serve --openenv`` only if something uses it.

``openenv.core.env_server`` imports its web interface, and Gradio with it, whenever it is
imported: 3.6 of the 6.1 s a bridged env's import takes on a quiet 2-core machine, paid by
the front and again by every ``--isolated`` env process, a replacement included. A gRPC
server never serves that UI. So ``serve --openenv`` puts a stand-in for the module in
``sys.modules`` of its own process and, through :data:`VARIABLE`, of the env processes it
spawns: the real module is imported the first time something uses it (an env's
server/app.py that calls ``create_web_interface_app(...)`` itself, as some do), not
before. ``ENABLE_WEB_INTERFACE``, OpenEnv's switch for the UI, imports it as usual. Other
processes that import the integration (a trainer using its client) are left as they are.

This module imports nothing of OpenEnv: it must run before the first import of it.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from typing import Any

__all__ = ["VARIABLE", "leave_out_in_servers", "leave_out_web_ui"]

#: Set by ``serve --openenv`` for itself and inherited by its env processes.
VARIABLE = "OPENENV_GRPC_LAZY_WEB_UI"
_MODULE = "openenv.core.env_server.web_interface"


def leave_out_web_ui() -> None:
    """Defer OpenEnv's web interface in this process and the processes it spawns, unless
    ``ENABLE_WEB_INTERFACE`` is on or it is imported already."""
    os.environ[VARIABLE] = "1"
    leave_out_in_servers()


def leave_out_in_servers() -> None:
    """What :func:`leave_out_web_ui` does, in a process where ``serve --openenv`` asked
    for it (the server's own, or an env process it spawned)."""
    wanted = os.environ.get("ENABLE_WEB_INTERFACE", "false").lower() in ("true", "1", "yes")
    if os.environ.get(VARIABLE) == "1" and not wanted and _MODULE not in sys.modules:
        sys.modules[_MODULE] = _StandIn(_MODULE)


def _real() -> types.ModuleType:
    """OpenEnv's web interface module, imported now in place of the stand-in."""
    if isinstance(sys.modules.get(_MODULE), _StandIn):
        del sys.modules[_MODULE]
    return importlib.import_module(_MODULE)


def create_web_interface_app(*args: Any, **kwargs: Any) -> Any:
    """OpenEnv's ``create_web_interface_app``, imported at the first call."""
    return _real().create_web_interface_app(*args, **kwargs)


class WebInterfaceManager:
    """OpenEnv's ``WebInterfaceManager``, imported at the first instance (its instances
    are the real class's; only ``isinstance`` against this stand-in differs)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return _real().WebInterfaceManager(*args, **kwargs)


class _StandIn(types.ModuleType):
    """The module until it is used: its two names that OpenEnv's package imports are
    stand-ins; any other name imports the real module."""

    create_web_interface_app = staticmethod(create_web_interface_app)
    WebInterfaceManager = WebInterfaceManager

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # the import system's probes (__path__ ...): not a use
            raise AttributeError(name)
        return getattr(_real(), name)
