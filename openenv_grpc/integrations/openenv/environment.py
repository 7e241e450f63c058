"""An OpenEnv ``Environment`` subclass, served unchanged: :func:`openenv_environment`.

OpenEnv 0.10's contract (``openenv.core.env_server.interfaces.Environment``):
``reset(seed=None, episode_id=None, **kwargs) -> Observation``, ``step(action) ->
Observation``, a ``state`` property, ``close()``, optional ``reset_async`` /
``step_async``; the observation carries ``done``, ``reward`` and ``metadata``. The
adapter made here is an ordinary openenv-grpc :class:`~openenv_grpc.Environment` (or
:class:`~openenv_grpc.AsyncEnvironment`) whose four message types are built from the
env's pydantic models at start-up (see :mod:`.schema`), so the server, Info, reflection,
the console and every client treat it like a native env:

- **reset**: ``seed`` and ``episode_id`` are passed when ``reset`` accepts them; the
  reset options message has one field per other named parameter of ``reset`` (typed
  from its annotations) plus ``kwargs`` (a Struct) when it takes ``**kwargs``;
- **step**: the action message is validated by the env's own Action model; a
  ``ValidationError`` is an in-band ``INVALID_ARGUMENT`` and the episode goes on;
- **results**: ``reward`` (None: ``no_reward``) and ``done`` (-> ``terminated``; OpenEnv
  has no truncation) land in the result's own fields, ``metadata`` in ``info`` *and* in the
  observation message (as OpenEnv's own ``serialize_observation`` puts it at both
  places: ``info`` is the protocol's Struct, whose numbers are doubles; the observation's
  copy is JSON text with ints intact); the observation message holds the other fields;
- **errors**: an exception in ``step`` is an in-band ``INTERNAL`` and the episode goes
  on, as in OpenEnv (the adapter sets ``step_errors_end_episode = False``);
- **capacity**: an env that does not declare ``SUPPORTS_CONCURRENT_SESSIONS = True``
  serves one session at a time whatever the server's setting (``max_sessions = 1``),
  however it is served;
- **execution**: like OpenEnv's server: an env that overrides ``reset_async`` or
  ``step_async`` is awaited on the event loop (its other methods run in a thread); one
  that sets ``REQUIRES_SINGLE_THREAD_EXECUTOR`` has every call of every instance on one
  thread; the others run on the server's thread pool. An MCP env's ``mcp_session()`` is
  held open for the whole session, as OpenEnv's WebSocket route does.

Types come from, in order: the arguments given here (``serve --openenv pkg.server.app:app``
passes the ones of the env's own ``create_app`` call); the env's generic base
(``Environment[MyAction, MyObservation, MyState]``); the annotations of ``step``
(``action`` and the return) and of the ``state`` property -- which is how OpenEnv's
template and docs write envs. OpenEnv's bare ``Action`` / ``Observation`` (a ``step``
annotated with the base classes) are refused: they have no fields to send. An
``MCPEnvironment`` declared with the base ``Action`` serves OpenEnv's tool surface:
``ListToolsAction`` or ``CallToolAction`` (and the env's own action, if it names one),
answered by ``ListToolsObservation``, ``CallToolObservation`` or a plain ``Observation``.

The classes pickle as the recipe that rebuilds them, so ``--isolated`` workers (spawned
processes) rebuild the same types from the same env class.
"""

from __future__ import annotations

import concurrent.futures
import copyreg
import functools
import hashlib
import inspect
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from openenv.core.env_server.interfaces import Environment as OpenEnvEnvironment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import (
    CallToolAction,
    CallToolObservation,
    ListToolsAction,
    ListToolsObservation,
)
from openenv.core.env_server.types import Action, Observation, State
from pydantic import BaseModel

from openenv_grpc.environment import AsyncEnvironment, Environment
from openenv_grpc.integrations.openenv.bridge import Bridge
from openenv_grpc.integrations.openenv.execution import async_methods, sync_methods
from openenv_grpc.integrations.openenv.schema import ModelPlan, SchemaBuilder, UnionPlan
from openenv_grpc.integrations.openenv.signatures import (
    has_mcp,
    hints,
    overrides,
    reset_method,
    reset_parameters,
)

__all__ = ["OpenEnvTypes", "openenv_environment"]

#: Observation fields that travel in the result, not in the observation message.
RESULT_FIELDS = frozenset({"done", "reward"})

#: The adapter classes made in this process, by the name Info reports: the OpenEnv door
#: publishes their own models' schemas and metadata (:mod:`.published`).
BRIDGED: dict[str, type[Any]] = {}


@dataclass(frozen=True)
class OpenEnvTypes:
    """The pydantic models of an OpenEnv env (a tuple for unions)."""

    action: tuple[type[BaseModel], ...]
    observation: tuple[type[BaseModel], ...]
    state: type[BaseModel]


class _Bridged(type):
    """The metaclass of adapter classes: they pickle as the recipe that rebuilds them."""

    _recipe: tuple[Any, ...]


def _reduce(cls: _Bridged) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    return _rebuild, cls._recipe


copyreg.pickle(_Bridged, _reduce)


def _rebuild(*recipe: Any) -> type[Any]:
    return _adapter(*recipe)


def openenv_environment(
    env_class: type[OpenEnvEnvironment] | Callable[[], OpenEnvEnvironment],
    *,
    action: type[BaseModel] | tuple[type[BaseModel], ...] | None = None,
    observation: type[BaseModel] | tuple[type[BaseModel], ...] | None = None,
    state: type[BaseModel] | None = None,
    name: str | None = None,
) -> type[Any]:
    """An openenv-grpc environment class serving ``env_class`` (an OpenEnv env) unchanged.

    ``env_class`` may also be a factory (a function returning the env, as some envs hand
    to ``create_app``): each session's env is made by calling it, and the env's class is
    read from its return annotation, else from one instance made (and closed) here.
    ``action`` / ``observation`` / ``state`` override the models read from the class (a
    tuple serves any of several models); ``name`` is the name Info reports (default: the
    class name). The same arguments return the same class.

    Raises:
        TypeError: ``env_class`` is not an OpenEnv Environment (or a factory of one), or
            its models cannot be found (pass them), or a type is not a pydantic model,
            or is OpenEnv's bare base class.
    """
    return _adapter(env_class, action, observation, state, name)  # type: ignore[arg-type]


@functools.cache  # one class (and one set of message types) per recipe
def _adapter(
    env_class: type[OpenEnvEnvironment] | Callable[[], OpenEnvEnvironment],
    action: type[BaseModel] | tuple[type[BaseModel], ...] | None,
    observation: type[BaseModel] | tuple[type[BaseModel], ...] | None,
    state: type[BaseModel] | None,
    name: str | None,
) -> type[Any]:
    recipe = (env_class, action, observation, state, name)
    factory: Callable[[], OpenEnvEnvironment] = env_class
    env_class = _env_class_of(env_class)
    found = _find_types(env_class, action, observation, state)
    label = name or env_class.__name__
    module = env_class.__module__
    # One file (and package) per recipe, named the same in every process that builds it
    # (an --isolated worker must agree with the front on the type urls).
    stem = re.sub(r"\W", "_", label)
    stem = stem if stem[:1].isalpha() else f"env_{stem}"  # a package component: a letter first
    if (action, observation, state) != (None, None, None):
        models = repr([_qualnames(x) for x in (action, observation, state)]).encode()
        stem += "_" + hashlib.sha256(models).hexdigest()[:8]
    builder = SchemaBuilder(
        f"openenv_bridge/{module.replace('.', '/')}/{stem}.proto",
        f"openenv_bridge.{module}.{stem}",
    )
    # Message names are identifiers; the name an app gives ("tbench2_env (local mode)")
    # need not be one.
    ident = "".join(p[:1].upper() + p[1:] for p in re.split(r"\W+|_", label) if p) or "Env"
    ident = f"Env{ident}" if ident[0].isdigit() else ident
    action_plan = _plan(builder, f"{ident}Action", found.action, frozenset())
    observation_plan = _plan(builder, f"{ident}Observation", found.observation, RESULT_FIELDS)
    state_plan = builder.model(found.state)
    reset, asynchronous = reset_method(env_class)
    parameters, var_keyword = reset_parameters(reset)
    options_plan = builder.parameters(f"{ident}ResetOptions", parameters, hints(reset), var_keyword)
    builder.build()
    bridge = Bridge(
        env_class, found, action_plan, observation_plan, state_plan, options_plan, factory
    )
    needs_loop = asynchronous or overrides(env_class, "step_async") or has_mcp(env_class)
    single_thread = bool(getattr(env_class, "REQUIRES_SINGLE_THREAD_EXECUTOR", False))
    concurrency_safe = bool(getattr(env_class, "SUPPORTS_CONCURRENT_SESSIONS", False))
    base: Any = AsyncEnvironment if needs_loop or single_thread else Environment
    generic = base[
        action_plan.message_class,
        observation_plan.message_class,
        state_plan.message_class,
        options_plan.message_class,
    ]
    body: dict[str, Any] = {
        "name": label,
        "description": (inspect.getdoc(env_class) or "").strip().split("\n")[0],
        "openenv_class": env_class,
        "openenv_concurrent": concurrency_safe,
        # OpenEnv serves such an env one session at a time: so does every server here.
        "max_sessions": None if concurrency_safe else 1,
        # OpenEnv answers an exception in step with an error and keeps the episode.
        "step_errors_end_episode": False,
        "_bridge": bridge,
        "_recipe": recipe,
        # OpenEnv runs a sync env's calls on a worker thread, as they may block (network,
        # subprocesses). Here they start there too and are measured (placement.py): a
        # call group moves onto the event loop only once it is cheap and never blocks,
        # and back at its first calls that block or take long.
        "runs_inline": None,
        "__module__": __name__,
        "__doc__": f"{env_class.__qualname__} (an OpenEnv environment), served by openenv-grpc.",
    }
    if base is AsyncEnvironment:
        executor = concurrent.futures.ThreadPoolExecutor(1) if single_thread else None
        body.update(async_methods(bridge, executor))
    else:
        body.update(sync_methods(bridge))
    adapter = types.new_class(
        f"{env_class.__name__}Bridge",
        (generic,),
        {"metaclass": _Bridged},
        lambda ns: ns.update(body),
    )
    BRIDGED[label] = adapter
    return adapter


# -- finding the models ------------------------------------------------------------------


def _env_class_of(target: Any) -> type[OpenEnvEnvironment]:
    """The env class of ``target``: itself, or what the factory ``target`` returns."""
    if isinstance(target, type):
        if issubclass(target, OpenEnvEnvironment):
            return target
        raise TypeError(f"{target!r} is not a subclass of openenv's Environment")
    if not callable(target):
        raise TypeError(f"{target!r} is neither an OpenEnv Environment class nor a factory")
    while isinstance(target, functools.partial):  # partial(MyEnvironment, setting=...)
        target = target.func
        if isinstance(target, type):
            return _env_class_of(target)
    returned = hints(target).get("return")
    if isinstance(returned, type) and issubclass(returned, OpenEnvEnvironment):
        return returned
    # A factory function that names one env class: `return ChatEnvironment(tokenizer=...)`
    # (no env is made: making one may need what only a session has, a model, a server).
    code, names = getattr(target, "__code__", None), getattr(target, "__globals__", {})
    named = {
        value for name in getattr(code, "co_names", ())
        if isinstance(value := names.get(name), type) and issubclass(value, OpenEnvEnvironment)
    }  # fmt: skip
    if len(named) == 1:
        return named.pop()
    # As OpenEnv's own server does for a factory: make one to see what it makes.
    try:
        probe = target()
    except Exception as exc:
        raise TypeError(f"the factory {_name(target)}() raised {exc!r}") from exc
    try:
        if not isinstance(probe, OpenEnvEnvironment):
            raise TypeError(
                f"the factory {_name(target)}() returned a {type(probe).__name__}, not an "
                "openenv Environment"
            )
        return type(probe)
    finally:
        close = getattr(probe, "close", None)
        if callable(close):
            close()


def _name(target: Any) -> str:
    return str(getattr(target, "__qualname__", None) or repr(target))


def _find_types(
    env_class: type[OpenEnvEnvironment],
    action: type[BaseModel] | tuple[type[BaseModel], ...] | None,
    observation: type[BaseModel] | tuple[type[BaseModel], ...] | None,
    state: type[BaseModel] | None,
) -> OpenEnvTypes:
    generic = _generic_args(env_class)
    step_hints = hints(env_class.step)
    state_property = inspect.getattr_static(env_class, "state", None)
    state_hint = (
        hints(state_property.fget).get("return") if isinstance(state_property, property) else None
    )
    found_action = action or generic[0] or step_hints.get("action")
    found_observation = observation or generic[1] or step_hints.get("return")
    found_state = state or generic[2] or state_hint or State
    if issubclass(env_class, MCPEnvironment):
        # OpenEnv routes list_tools / call_tool to every MCP env whatever it declares.
        found_action = _unique(ListToolsAction, CallToolAction, *_own(found_action, Action))
        found_observation = _unique(
            ListToolsObservation,
            CallToolObservation,
            *_own(found_observation, Observation),
            Observation,
        )
    else:
        pairs: list[tuple[str, Any, type[BaseModel]]] = [
            ("action", found_action, Action), ("observation", found_observation, Observation)
        ]  # fmt: skip
        bare = [
            f"{role} is openenv's base {base.__name__} (no fields of its own)"
            for role, value, base in pairs
            if value is base
        ]
        if bare:
            raise TypeError(
                f"{env_class.__qualname__}: its {' and its '.join(bare)}: step is probably "
                "annotated with the base classes. Serve the env's own app, whose create_app "
                "call names the real ones (--openenv pkg.server.app:app), or name them: "
                "--action MODULE:ACTION --observation MODULE:OBSERVATION "
                "(openenv_environment(..., action=, observation=))"
            )
    missing = [
        role for role, value in (("action", found_action), ("observation", found_observation))
        if value is None
    ]  # fmt: skip
    if missing:
        raise TypeError(
            f"{env_class.__qualname__}: cannot find its {' and '.join(missing)} model: serve "
            "the env's own app (--openenv pkg.server.app:app), or annotate step(self, "
            "action: MyAction) -> MyObservation, or name them: --action MODULE:ACTION "
            "--observation MODULE:OBSERVATION (openenv_environment(..., action=, "
            "observation=))"
        )
    result = OpenEnvTypes(_as_tuple(found_action), _as_tuple(found_observation), found_state)
    for model in (*result.action, *result.observation, result.state):
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise TypeError(f"{env_class.__qualname__}: {model!r} is not a pydantic model")
    return result


def _generic_args(env_class: type[Any]) -> tuple[Any, Any, Any]:
    for klass in env_class.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            if typing.get_origin(base) is OpenEnvEnvironment or (
                isinstance(typing.get_origin(base), type)
                and issubclass(typing.get_origin(base), OpenEnvEnvironment)
            ):
                # A TypeVar (an unparametrized generic) gives nothing.
                args = [a if isinstance(a, type) else None for a in typing.get_args(base)]
                padded = [*args, None, None, None]
                return padded[0], padded[1], padded[2]
    return None, None, None


def _own(value: Any, base: type[BaseModel]) -> tuple[Any, ...]:
    return () if value in (None, base) else _as_tuple(value)


def _unique(*models: Any) -> tuple[Any, ...]:
    return tuple(dict.fromkeys(models))


def _qualnames(value: Any) -> list[str]:
    return [f"{m.__module__}.{m.__qualname__}" for m in _as_tuple(value) if m is not None]


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return value if isinstance(value, tuple) else (value,)


def _plan(
    builder: SchemaBuilder, name: str, models: tuple[type[BaseModel], ...], exclude: frozenset[str]
) -> ModelPlan | UnionPlan:
    if len(models) == 1:
        return builder.model(models[0], exclude)
    return builder.union(name, list(models), exclude)
