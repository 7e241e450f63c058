"""The env contract: message types are read from the generic base and checked at start."""

from __future__ import annotations

import functools
from typing import Any

import pytest
from google.protobuf.empty_pb2 import Empty

from openenv_grpc import AsyncEnvironment, Environment, Transition
from openenv_grpc.environment import message_types
from openenv_grpc.server.model.spec import EnvSpec, ExecutionMode
from openenv_grpc_envs.echo import (
    EchoAction,
    EchoEnvironment,
    EchoObservation,
    EchoResetOptions,
    EchoState,
)


def test_types_come_from_the_generic_base() -> None:
    types = message_types(EchoEnvironment)
    assert (types.action, types.observation, types.state, types.reset_options) == (
        EchoAction,
        EchoObservation,
        EchoState,
        EchoResetOptions,
    )


def test_subclass_of_an_env_inherits_its_types() -> None:
    class Louder(EchoEnvironment):
        pass

    assert message_types(Louder).observation is EchoObservation


def test_undeclared_types_are_refused() -> None:
    class Bare(Environment):  # type: ignore[type-arg]
        pass

    with pytest.raises(TypeError, match="does not declare its message types"):
        message_types(Bare)


def test_non_message_types_are_refused() -> None:
    class Wrong(Environment[EchoAction, str, EchoState, Empty]):  # type: ignore[type-var]
        pass

    with pytest.raises(TypeError, match="observation type must be a protobuf message"):
        message_types(Wrong)


def test_non_environment_is_refused() -> None:
    with pytest.raises(TypeError, match="not a subclass of Environment"):
        message_types(dict)


class _Slow(Environment[EchoAction, EchoObservation, EchoState, Empty]):
    """A blocking env."""

    runs_inline = False


class _Undeclared(Environment[EchoAction, EchoObservation, EchoState, Empty]):
    pass


class _Async(AsyncEnvironment[EchoAction, EchoObservation, EchoState, Empty]):
    pass


def test_execution_mode_follows_the_declaration() -> None:
    assert EnvSpec.from_factory(EchoEnvironment).mode is ExecutionMode.INLINE
    assert EnvSpec.from_factory(_Slow).mode is ExecutionMode.POOL
    assert EnvSpec.from_factory(_Async).mode is ExecutionMode.ASYNC
    measured = EnvSpec.from_factory(_Undeclared, inline_threshold=0.002)
    assert measured.mode is ExecutionMode.MEASURED
    assert measured.placement is not None and measured.placement.threshold == 0.002
    # Threshold 0: what leaves runs_inline unset runs on the pool.
    assert EnvSpec.from_factory(_Undeclared, inline_threshold=0).mode is ExecutionMode.POOL
    assert EnvSpec.from_factory(EchoEnvironment).placement is None


def test_factories_are_resolved_to_their_class() -> None:
    def make() -> EchoEnvironment:
        return EchoEnvironment()

    assert EnvSpec.from_factory(make).env_class is EchoEnvironment
    assert EnvSpec.from_factory(functools.partial(make)).env_class is EchoEnvironment

    def unannotated():  # type: ignore[no-untyped-def]
        return EchoEnvironment()

    with pytest.raises(TypeError, match="annotated with the Environment class"):
        EnvSpec.from_factory(unannotated)


def test_spec_describes_the_env() -> None:
    spec = EnvSpec.from_factory(EchoEnvironment)
    assert (spec.name, spec.version) == ("echo", EchoEnvironment.version)
    assert spec.action_url == "type.googleapis.com/openenv_grpc_envs.echo.v1.EchoAction"
    # Dependencies first, so a reader can add the files to a pool in order.
    assert [f.name for f in spec.descriptors.file] == [
        "google/protobuf/struct.proto",
        "openenv_grpc/tools/v1/tools.proto",
        "openenv_grpc_envs/echo/v1/echo.proto",
    ]
    assert EnvSpec.from_factory(_Slow).description == "A blocking env."


def test_transition_defaults() -> None:
    t: Transition[Any] = Transition(EchoObservation())
    assert (t.reward, t.terminated, t.truncated, t.info) == (0.0, False, False, None)
