"""``openenv-grpc console``: serve the console's web app until SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import ipaddress
import signal
import sys
from typing import Any

import grpc
from aiohttp import web

from openenv_grpc.console.app import create_app
from openenv_grpc.console.target import EnvTarget

__all__ = ["run_console", "serve_console"]


async def serve_console(
    address: str,
    host: str = "127.0.0.1",
    port: int = 8080,
    *,
    credentials: grpc.ChannelCredentials | None = None,
    token: str | None = None,
    call_timeout: float | None = 60.0,
    connect_timeout: float = 10.0,
    live_period: float = 1.0,
) -> None:
    """Serve the console for the env server at ``address`` on ``host:port`` (0 picks a
    free port) until SIGINT or SIGTERM; prints its URL once it listens. The env server
    must answer its Info RPC within ``connect_timeout`` seconds.

    Raises:
        grpc.aio.AioRpcError: the env server did not answer its Info RPC.
        OSError: the address could not be bound.
    """
    # The channel belongs to this event loop, so the target is made here.
    target = EnvTarget(address, credentials=credentials, token=token, call_timeout=call_timeout)
    app = create_app(target, live_period=live_period, connect_timeout=connect_timeout)
    runner = web.AppRunner(app, handle_signals=False)
    try:
        await runner.setup()  # runs on_startup: reads the env server's Info
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1] if runner.addresses else port
        shown = f"[{host}]" if ":" in host else host
        print(
            f"openenv-grpc console: http://{shown}:{bound}/ "
            f"(env {target.info.env_name!r} at {address})",
            flush=True,
        )
        if not _is_loopback(host):
            print(
                "openenv-grpc console: warning: listening beyond this machine; whoever "
                "reaches the page can open sessions with the console's credentials",
                file=sys.stderr,
                flush=True,
            )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()  # closes the sockets and with them their sessions
        await target.close()  # the channel: this function made the target


def run_console(address: str, host: str, port: int, **kwargs: Any) -> int:
    """Run :func:`serve_console` (``kwargs`` go to it); returns the process exit code."""
    try:
        asyncio.run(serve_console(address, host, port, **kwargs))
    except grpc.aio.AioRpcError as exc:
        print(f"openenv-grpc: {address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"openenv-grpc: console: {exc}", file=sys.stderr)
        return 1
    return 0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
