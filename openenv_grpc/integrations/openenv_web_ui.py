"""OpenEnv's Gradio web UI, imported by ``serve --openenv`` only when something uses it.

``openenv.core.env_server`` imports its web interface, and Gradio with it, whenever it is
imported: 3.6 of the 6.1 s a bridged env's import takes on a quiet 2-core machine, paid by
the front and again by every ``--isolated`` env process, a replacement included. A gRPC
server never serves that UI. So in ``serve --openenv`` processes (the server's own and,
through :data:`VARIABLE`, the env processes it spawns) OpenEnv's package is imported
without it, and its names are then resolved the way OpenEnv resolves its own lazy names
(a module ``__getattr__``, PEP 562): the first use of ``create_web_interface_app``,
``WebInterfaceManager`` or ``openenv.core.env_server.web_interface``, by any route,
imports the real module and gets the real objects. No stand-in outlives the import: what
a user's code sees is OpenEnv's own module and classes (``isinstance``, subclasses,
``__spec__``, ``import ... as``, ``import *``), and without Gradio the names are ``None``
as OpenEnv makes them. ``ENABLE_WEB_INTERFACE``, OpenEnv's switch for the UI, imports it
as usual. Other processes that import the integration (a trainer using its client) are
left as they are.

This module imports nothing of OpenEnv: it must run before the first import of it.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import threading
import types
from typing import Any

__all__ = ["VARIABLE", "leave_out_in_servers", "leave_out_web_ui"]

log = logging.getLogger(__name__)

#: Set by ``serve --openenv`` for itself and inherited by its env processes.
VARIABLE = "OPENENV_GRPC_LAZY_WEB_UI"
_PACKAGE = "openenv.core.env_server"
_MODULE = f"{_PACKAGE}.web_interface"
#: The names OpenEnv's packages import from the web interface (``None`` without Gradio).
_NAMES = ("create_web_interface_app", "WebInterfaceManager")
#: What importing the web interface binds on OpenEnv's package: itself and its own imports.
_SUBMODULES = ("web_interface", "gradio_ui", "gradio_theme")


def leave_out_web_ui() -> None:
    """Defer OpenEnv's web interface in this process and the processes it spawns, unless
    ``ENABLE_WEB_INTERFACE`` is on or OpenEnv is imported already."""
    os.environ[VARIABLE] = "1"
    leave_out_in_servers()


def leave_out_in_servers() -> None:
    """What :func:`leave_out_web_ui` does, in a process where ``serve --openenv`` asked
    for it (the server's own, or an env process it spawned)."""
    wanted = os.environ.get("ENABLE_WEB_INTERFACE", "false").lower() in ("true", "1", "yes")
    if os.environ.get(VARIABLE) != "1" or wanted or _PACKAGE in sys.modules:
        return
    if importlib.util.find_spec("openenv") is None:
        return  # the extra is missing: the bridge says so itself
    _import_without_web_ui()


class _Pending:
    """What OpenEnv's packages bind while they are imported without the web interface;
    every binding is replaced right after (:func:`_import_without_web_ui`), so a use of
    one means OpenEnv keeps a reference this module does not know of: say so."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{self.name} was deferred by openenv-grpc and a reference to the placeholder "
            f"escaped; set ENABLE_WEB_INTERFACE=true to import OpenEnv's web UI eagerly"
        )

    def __repr__(self) -> str:
        return f"<deferred {self.name}>"


def _import_without_web_ui() -> None:
    """Import OpenEnv's package with a placeholder for the web interface, then replace
    every binding of the placeholder by a lazy name of its module."""
    stand_in = types.ModuleType(_MODULE)
    pending = {name: _Pending(name) for name in _NAMES}
    vars(stand_in).update(pending)
    before = set(sys.modules)
    # Only for this call: a thread importing OpenEnv meanwhile would see the placeholder
    # too, so this runs first thing in a server or env process (cli.py, the bridge).
    sys.modules[_MODULE] = stand_in
    try:
        importlib.import_module(_PACKAGE)
        whole = False
    except Exception:
        # OpenEnv used a placeholder while importing (a version this does not know), or
        # failed for a reason of its own: import it as it is, which raises the latter.
        whole = True
    finally:
        if sys.modules.get(_MODULE) is stand_in:
            del sys.modules[_MODULE]
    if whole:
        _forget_new_openenv_modules(before)
        importlib.import_module(_PACKAGE)
        log.warning("OpenEnv did not import without its web UI: imported it whole")
        return
    deferred = _Deferred()
    for name in set(sys.modules) - before:
        namespace = getattr(sys.modules[name], "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        # The submodules a real import binds on the package, and every binding of a
        # placeholder: name -> "" (a submodule the import binds itself), "." (the
        # module), else the module's name for it (a binding may be an alias).
        lazy = dict.fromkeys(_SUBMODULES, "") if name == _PACKAGE else {}
        for key, value in list(namespace.items()):
            if value is stand_in:
                lazy[key] = "."
            elif isinstance(value, _Pending) and pending.get(value.name) is value:
                lazy[key] = value.name
            else:
                continue
            del namespace[key]
        if lazy:
            deferred.add(namespace, lazy)


def _forget_new_openenv_modules(before: set[str]) -> None:
    for name in set(sys.modules) - before:
        if name == "openenv" or name.startswith("openenv."):
            del sys.modules[name]


class _Deferred:
    """The modules whose web-interface names wait for a first use. The first use of any
    of them, in any module, imports the real module once and binds the names everywhere,
    as the eager import would have; then each module's own ``__getattr__`` and ``__dir__``
    (or none) are put back, so it looks as it would have from then on."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: (module namespace, its lazy names, its own hooks, the hooks put there)
        self._waiting: list[
            tuple[dict[str, Any], dict[str, str], dict[str, Any], dict[str, Any]]
        ] = []

    def add(self, namespace: dict[str, Any], lazy: dict[str, str]) -> None:
        """Give a module the names in ``lazy`` through a module ``__getattr__`` (PEP
        562), before the one it had, if any."""
        own: dict[str, Any] = {
            key: namespace[key] for key in ("__getattr__", "__dir__") if key in namespace
        }
        previous = own.get("__getattr__")
        listed = own.get("__dir__")
        module_name = namespace.get("__name__", "?")

        def __getattr__(name: str) -> Any:  # a module __getattr__ (PEP 562)
            if name in lazy:
                self.resolve()
                if name in namespace:
                    return namespace[name]
            if previous is not None:
                return previous(name)
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")

        def __dir__() -> list[str]:  # dir() lists the lazy names too, as before
            return sorted(set(listed() if listed is not None else namespace) | set(lazy))

        mine: dict[str, Any] = {"__getattr__": __getattr__, "__dir__": __dir__}
        namespace.update(mine)
        self._waiting.append((namespace, lazy, own, mine))

    def resolve(self) -> None:
        """Import the web interface (once) and bind its names in every waiting module.
        Without Gradio the two names are None, as OpenEnv's package makes them, and the
        submodules are absent. Any other import error is raised to this use (and the
        next use tries again, as an import would)."""
        if not self._waiting:
            return
        try:
            module: types.ModuleType | None = importlib.import_module(_MODULE)
        except ModuleNotFoundError:
            module = None
        if module is not None and getattr(module.__spec__, "_initializing", False):
            return  # read while the module itself imports: not there yet, as eagerly
        with self._lock:
            waiting, self._waiting = self._waiting, []
            for namespace, lazy, own, mine in waiting:
                for key, bound in lazy.items():
                    # setdefault: a name the user assigned meanwhile stays theirs.
                    if bound == ".":
                        if module is not None:
                            namespace.setdefault(key, module)
                    elif bound:
                        namespace.setdefault(key, getattr(module, bound, None))
                for key, hook in mine.items():
                    if namespace.get(key) is not hook:
                        continue  # replaced by the user meanwhile: theirs stays
                    if key in own:
                        namespace[key] = own[key]
                    else:
                        del namespace[key]
