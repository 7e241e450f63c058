"""``environment_factory(target, client)``: a served env as TRL's ``environment_factory``."""

from __future__ import annotations

import dataclasses
import types
import weakref
from typing import Any

import grpc

from openenv_grpc import AsyncSession, OpenRetry, StepResult
from openenv_grpc.integrations.trl.environment import SessionEnvironment, message_types
from openenv_grpc.integrations.trl.runtime import Runtime
from openenv_grpc.integrations.trl.tools import (
    ToolFields,
    action_field_method,
    describe_tool_result,
    find_tool_fields,
    tool_protocol_methods,
)
from openenv_grpc.tools import ToolList

__all__ = ["EnvironmentFactory", "environment_factory"]

#: Envs with tools written by hand, by action type: (module, class).
_KNOWN = {
    "openenv_grpc_envs.wordle.v1.WordleAction": ("openenv_grpc.integrations.trl.wordle", "Wordle"),
    "openenv_grpc_envs.coding.v1.CodingAction": ("openenv_grpc.integrations.trl.coding", "Coding"),
}


class EnvironmentFactory:
    """What TRL calls for each environment instance; owns the loop thread and channel
    all its instances share.

    Calling it returns a new instance of :attr:`environment_class`. :meth:`close` (or
    leaving a ``with`` block) closes every session its instances still hold; without
    it, each session closes when TRL drops its instance, and the rest at exit.
    """

    def __init__(self, environment_class: type[SessionEnvironment], runtime: Runtime) -> None:
        self.environment_class = environment_class
        self._runtime = runtime

    def __call__(self) -> SessionEnvironment:
        return self.environment_class()

    @property
    def open_instances(self) -> int:
        """Instances alive now (each holds at most one session)."""
        return len(self.environment_class._instances)

    def close(self) -> None:
        """Close every instance's session, then the channel and the loop thread."""
        for instance in list(self.environment_class._instances):
            instance._finalizer()
        self._runtime.stop()

    def __enter__(self) -> EnvironmentFactory:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _ToolProtocolEnvironment(SessionEnvironment):
    """An env whose tools come from the server (the tools protocol, like echo)."""

    _tool_fields: ToolFields

    def _reset_text(self, result: StepResult[Any]) -> str | None:
        observation = type(result.observation)()
        observation.CopyFrom(result.observation)
        observation.ClearField(self._tool_fields.tools)  # TRL shows the tools already
        return super()._reset_text(dataclasses.replace(result, observation=observation))

    def _step_text(self, result: StepResult[Any]) -> str:
        observation = result.observation
        if observation.HasField(self._tool_fields.tool_result):
            text = describe_tool_result(getattr(observation, self._tool_fields.tool_result))
            return text + ("\nThe episode is over." if result.done else "")
        return super()._step_text(result)


def environment_factory(
    target: str,
    client: type[Any],
    *,
    environment: type[SessionEnvironment] | None = None,
    keepalive: float | None = 120.0,
    call_timeout: float | None = 300.0,
    retry: OpenRetry | None = None,
    credentials: grpc.ChannelCredentials | None = None,
    token: str | None = None,
    name: str | None = None,
) -> EnvironmentFactory:
    """Turn the env served at ``target`` into a TRL ``environment_factory``.

    ``client`` is the env's typed client class (``WordleEnv`` or ``AsyncWordleEnv``);
    its message types pick the tools: wordle gets ``guess(word)``, coding
    ``run_code(code)``, an env that lists tools (echo) one method per tool, any other
    env one ``act(...)`` tool taking the action's fields. ``environment`` overrides that
    with your own :class:`SessionEnvironment` subclass (tools as ``async def`` methods
    with type hints and a Google-style docstring, each returning ``await
    self._act(action)``).

    ``keepalive``: seconds without traffic after which a running episode pings the
    server (``state()``), so that the server's idle timeout does not end a game while
    the model is generating; None turns it off (keep it below the server's
    ``IDLE_TIMEOUT``). ``call_timeout`` bounds each reset. ``retry`` waits for room on a
    full server; ``credentials`` / ``token`` as for any session.

    Raises:
        TypeError: ``client`` is not a typed client.
        SessionRefused, EnvError: an env with server-listed tools could not be asked for
            them.
    """
    action, observation, _state, reset_options = message_types(client)
    runtime = Runtime(target, credentials)
    try:
        session_class = (
            client
            if issubclass(client, AsyncSession)
            else types.new_class(
                f"Async{client.__name__}",
                (AsyncSession[action, observation, _state, reset_options],),  # type: ignore[valid-type]
            )
        )
        base, body = _tools_for(environment, session_class, runtime, token)
        body.update(
            _runtime=runtime,
            _session_class=session_class,
            _reset_options_class=reset_options,
            _keepalive=keepalive,
            _call_timeout=call_timeout,
            _retry=retry,
            _token=token,
            _instances=weakref.WeakSet(),
            __module__=base.__module__,
        )
        bound = types.new_class(
            name or base.__name__.lstrip("_"), (base,), exec_body=lambda ns: ns.update(body)
        )
    except BaseException:
        runtime.stop()
        raise
    return EnvironmentFactory(bound, runtime)


def _tools_for(
    environment: type[SessionEnvironment] | None,
    session_class: type[AsyncSession[Any, Any, Any, Any]],
    runtime: Runtime,
    token: str | None,
) -> tuple[type[SessionEnvironment], dict[str, Any]]:
    """The base class and the extra class body (generated tools) for an env."""
    action, observation, _, _ = message_types(session_class)
    if environment is not None:
        return environment, {}
    known = _KNOWN.get(action.DESCRIPTOR.full_name)
    if known is not None:
        module = __import__(known[0], fromlist=[known[1]])
        return getattr(module, known[1]), {}
    fields = find_tool_fields(action.DESCRIPTOR, observation.DESCRIPTOR)
    if fields is not None:
        tools = runtime.run(_list_tools(runtime, fields, session_class, token), 60.0)
        body: dict[str, Any] = dict(tool_protocol_methods(tools, fields, action))
        body["_tool_fields"] = fields
        return _ToolProtocolEnvironment, body
    return SessionEnvironment, dict(action_field_method(action))


async def _list_tools(
    runtime: Runtime,
    fields: ToolFields,
    session_class: type[AsyncSession[Any, Any, Any, Any]],
    token: str | None,
) -> ToolList:
    """Ask a probe session for the env's tools: from the reset, else with a list call."""
    action = message_types(session_class)[0]
    async with session_class(runtime.channel, token=token) as session:
        first = await session.reset()
        tools: ToolList = getattr(first.observation, fields.tools)
        if not tools.tools:
            request = action()
            getattr(request, fields.list_call).SetInParent()
            tools = getattr((await session.step(request)).observation, fields.tools)
        return tools
