"""EnvServer embedded in an asyncio program: start, serve a session, drain, terminate."""

from __future__ import annotations

import asyncio

from openenv_grpc import EnvServer, ServerConfig
from openenv_grpc_envs.echo import AsyncEchoEnv, EchoAction, EchoEnvironment


def test_embedded_server_serves_and_drains() -> None:
    async def main() -> str:
        server = EnvServer(EchoEnvironment, ServerConfig(port=0, grace_period=0.5))
        port = await server.start()
        waiter = asyncio.ensure_future(server.wait_for_termination())
        async with AsyncEchoEnv(f"127.0.0.1:{port}") as env:
            await env.reset()
            echoed = (await env.step(EchoAction(message="inside"))).observation.echoed_message
        assert server.sessions.limiter.active == 0
        await server.drain()
        await asyncio.wait_for(waiter, 5)  # drain stops the server: the waiter returns
        return echoed

    assert asyncio.run(main()) == "inside"
