"""One browser WebSocket drives at most one env session at a time.

The page sends JSON commands (``open``, ``reset``, ``step``, ``state``, ``close``) one at
a time and gets one JSON answer per command. The session is an ordinary
:class:`~openenv_grpc.client.AsyncSession`; when the socket ends (the page closed or
reloaded) the session's stream ends too, so the server closes the env at once.

Every failure is an answer of ``{"type": "error", "op", "code", "message", "source",
"session"}``: ``code`` is the gRPC status name; ``source`` says whether the server or the
console refused; ``session`` says what is left: ``open`` (go on), ``lost`` (the stream
ended; open a new one) or ``none`` (there was none, or it was never opened).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from aiohttp import WSMsgType, web

from openenv_grpc.client.async_session import AsyncSession
from openenv_grpc.client.errors import CapacityError, EnvError, OpenEnvError, SessionLost
from openenv_grpc.client.outcome import StepOutcome
from openenv_grpc.console.target import EnvTarget, InputError
from openenv_grpc.console.views import json_safe, to_view

__all__ = ["SessionSocket"]

log = logging.getLogger(__name__)

#: Largest message the page may send (an action in JSON); larger ones end the socket.
MAX_COMMAND_BYTES = 4 * 1024 * 1024


class _Refused(Exception):
    """A command the console itself refuses; the session (if any) is untouched."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class SessionSocket:
    """The commands of one WebSocket, applied to its session."""

    def __init__(self, target: EnvTarget) -> None:
        self._target = target
        self._session: AsyncSession[Any, Any, Any, Any] | None = None

    async def run(self, ws: web.WebSocketResponse) -> None:
        """Answer commands until the socket closes, then end the session."""
        try:
            async for message in ws:
                if message.type is not WSMsgType.TEXT:
                    continue  # binary frames are not part of the protocol; pings are handled
                answer = await self.answer(message.data)
                try:
                    await ws.send_json(answer)
                except ConnectionResetError:
                    break  # the page went away while its command ran
        finally:
            await self.end()

    async def end(self) -> None:
        """End the session's stream, if one is open (the server closes the env)."""
        session, self._session = self._session, None
        if session is not None:
            await session.abort()

    async def answer(self, text: str) -> dict[str, Any]:
        """The answer to one command (JSON text from the page)."""
        op = "?"
        try:
            command = json.loads(text)
            if not isinstance(command, dict) or not isinstance(command.get("op"), str):
                raise _Refused("INVALID_ARGUMENT", 'a command is a JSON object with an "op"')
            op = command["op"]
            return await self._apply(op, command)
        except json.JSONDecodeError as exc:
            return self._error(op, "INVALID_ARGUMENT", f"not JSON: {exc}", "console")
        except _Refused as exc:
            return self._error(op, exc.code, exc.message, "console")
        except InputError as exc:
            return self._error(op, "INVALID_ARGUMENT", str(exc), "console")
        except TimeoutError as exc:
            return self._error(op, "DEADLINE_EXCEEDED", str(exc), "console")
        except SessionLost as exc:
            self._session = None
            return self._error(op, exc.code.name, exc.message, "server", session="lost")
        except CapacityError as exc:
            error = self._error(op, exc.code.name, exc.message, "server")
            error["retry_after"] = exc.retry_after
            return error
        except EnvError as exc:
            error = self._error(op, exc.code.name, exc.message, "server")
            error["exception_type"] = exc.exception_type
            return error
        except OpenEnvError as exc:  # refused: unreachable, draining, unauthenticated
            return self._error(op, exc.code.name, exc.message, "server")
        except Exception as exc:  # a console bug: report it, keep the page's socket
            log.exception("console: %r failed", op)
            return self._error(op, "INTERNAL", f"console error: {exc!r}", "console")

    def _error(
        self, op: str, code: str, message: str, source: str, session: str | None = None
    ) -> dict[str, Any]:
        if session is None:
            session = "open" if self._session is not None else "none"
        return {
            "type": "error",
            "op": op,
            "code": code,
            "message": message,
            "source": source,
            "session": session,
        }

    async def _apply(self, op: str, command: dict[str, Any]) -> dict[str, Any]:
        if op == "open":
            return await self._open()
        session = self._session
        if session is None:
            raise _Refused("FAILED_PRECONDITION", "no session is open: open one first")
        timeout = self._target.call_timeout
        if op == "reset":
            seed = command.get("seed")
            if seed is not None and (
                not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64
            ):
                raise _Refused("INVALID_ARGUMENT", "seed must be an integer in [0, 2**64)")
            episode_id = command.get("episode_id") or None
            if episode_id is not None and not isinstance(episode_id, str):
                raise _Refused("INVALID_ARGUMENT", "episode_id must be a string")
            options = command.get("options")
            packed = None if options is None else self._target.pack("reset_options", options)
            result = await session.reset(
                seed=seed, episode_id=episode_id, options=packed, timeout=timeout
            )
            return self._result("reset", result)
        if op == "step":
            action = self._target.pack("action", command.get("action"))
            return self._result("step", await session.step(action, timeout=timeout))
        if op == "state":
            state = self._target.decode("state", await session.state(timeout=timeout))
            return {"type": "state", "op": "state", "state": to_view(state)}
        if op == "close":
            self._session = None
            await session.close()
            return {"type": "closed", "op": "close", "session": "none"}
        raise _Refused("INVALID_ARGUMENT", f"unknown op {op!r}: open, reset, step, state, close")

    async def _open(self) -> dict[str, Any]:
        if self._session is not None:
            raise _Refused("FAILED_PRECONDITION", "a session is already open: close it first")
        target = self._target
        session: AsyncSession[Any, Any, Any, Any] = AsyncSession(target.stub, token=target.token)
        await session.open()
        self._session = session
        log.info("console session %s opened", session.session_id)
        return {"type": "opened", "op": "open", "session_id": session.session_id}

    def _result(self, op: str, result: StepOutcome[Any]) -> dict[str, Any]:
        observation = self._target.decode("observation", result.observation)
        return {
            "type": "result",
            "op": op,
            "observation": to_view(observation),
            "reward": None if result.no_reward else json_safe(result.reward),  # none given
            "terminated": result.terminated,
            "truncated": result.truncated,
            "episode_id": result.episode_id,
            "step_count": result.step_count,
            "info": json_safe(result.info),
        }
