"""The console's web app (aiohttp): the page, its static files and three endpoints.

- ``GET /api/info``: the env, its types and form schemas, capacity (JSON).
- ``GET /api/live``: a WebSocket of live figures, one per second while the page is open.
- ``GET /api/session``: a WebSocket that drives one env session (see session_socket).

Everything the page needs is served from the package: a Content-Security-Policy of
``'self'`` makes the browser refuse anything from elsewhere. WebSockets are only accepted
from the console's own pages (the Origin must match the Host), so another site open in
the same browser cannot drive sessions with the console's credentials.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from aiohttp import web

from openenv_grpc.console.live import LiveFigures
from openenv_grpc.console.session_socket import MAX_COMMAND_BYTES, SessionSocket
from openenv_grpc.console.target import EnvTarget

__all__ = ["STATIC_DIR", "create_app"]

STATIC_DIR = Path(__file__).parent / "static"


@dataclass
class _Console:
    """What the handlers share: the env server, the live poller, the open sockets."""

    target: EnvTarget
    live: LiveFigures
    connect_timeout: float
    sockets: set[web.WebSocketResponse] = field(default_factory=set)


_CONSOLE = web.AppKey("console", _Console)

_SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def create_app(
    target: EnvTarget, *, live_period: float = 1.0, connect_timeout: float = 10.0
) -> web.Application:
    """The console app for ``target``; it reads the target's Info on start-up (waiting up
    to ``connect_timeout`` seconds) and on shut-down closes its sockets (ending their
    sessions) and the live poller. The target's channel stays the caller's to close."""
    app = web.Application()
    app[_CONSOLE] = _Console(target, LiveFigures(target, live_period), connect_timeout)
    app.router.add_get("/", _index)
    app.router.add_get("/api/info", _info)
    app.router.add_get("/api/live", _live)
    app.router.add_get("/api/session", _session)
    app.router.add_static("/static/", STATIC_DIR, follow_symlinks=False)
    app.on_response_prepare.append(_add_security_headers)
    app.on_startup.append(_load_target)
    app.on_shutdown.append(_close_sockets)
    return app


async def _load_target(app: web.Application) -> None:
    console = app[_CONSOLE]
    await console.target.load(console.connect_timeout)


async def _close_sockets(app: web.Application) -> None:
    # Open sockets end their sessions as they close (SessionSocket.run's finally).
    for ws in list(app[_CONSOLE].sockets):
        await ws.close(code=1001, message=b"console shutting down")
    await app[_CONSOLE].live.stop()


async def _add_security_headers(request: web.Request, response: web.StreamResponse) -> None:
    response.headers.update(_SECURITY_HEADERS)


async def _index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "index.html")


async def _info(request: web.Request) -> web.Response:
    target = request.app[_CONSOLE].target
    return web.json_response(target.describe())


def _same_origin(request: web.Request) -> bool:
    """The request comes from one of our pages (browsers always send Origin on WebSocket
    handshakes; tools that send none are not browsers and carry no ambient credentials)."""
    origin = request.headers.get("Origin")
    if origin is None:
        return True
    return urlsplit(origin).netloc == request.host


async def _accept(request: web.Request) -> web.WebSocketResponse:
    if not _same_origin(request):
        raise web.HTTPForbidden(text="cross-origin WebSocket refused")
    ws = web.WebSocketResponse(heartbeat=20.0, max_msg_size=MAX_COMMAND_BYTES)
    await ws.prepare(request)
    request.app[_CONSOLE].sockets.add(ws)
    return ws


async def _live(request: web.Request) -> web.WebSocketResponse:
    ws = await _accept(request)
    live = request.app[_CONSOLE].live
    queue = live.subscribe()
    # The page sends nothing on this socket; reading notices when it goes away.
    closed = asyncio.create_task(ws.receive())
    try:
        while not ws.closed:
            reading = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({reading, closed}, return_when=asyncio.FIRST_COMPLETED)
            if closed in done:
                reading.cancel()
                break
            await ws.send_json(reading.result())
    finally:
        request.app[_CONSOLE].sockets.discard(ws)
        live.unsubscribe(queue)
        closed.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await closed
        await ws.close()
    return ws


async def _session(request: web.Request) -> web.WebSocketResponse:
    ws = await _accept(request)
    try:
        await SessionSocket(request.app[_CONSOLE].target).run(ws)
    finally:
        request.app[_CONSOLE].sockets.discard(ws)
    return ws
