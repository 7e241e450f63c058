"""The echo environment: each step observes the action's message, rewarded by length."""

from __future__ import annotations

from collections import deque

from openenv_grpc import Environment, InvalidAction, Transition
from openenv_grpc_envs.echo.v1.echo_pb2 import (
    EchoAction,
    EchoObservation,
    EchoResetOptions,
    EchoState,
)

__all__ = ["EchoEnvironment"]

#: Messages kept in the state's history.
HISTORY = 100
#: Longest message accepted; keeps a hostile client from growing the history unbounded.
MAX_MESSAGE_CHARS = 64 * 1024


class EchoEnvironment(Environment[EchoAction, EchoObservation, EchoState, EchoResetOptions]):
    """Echoes each message back; reward is 0.1 per character."""

    name = "echo"
    version = "1.0.0"
    description = "Echoes each message back; reward is 0.1 per character."
    runs_inline = True  # pure bookkeeping: microseconds per call

    def __init__(self) -> None:
        self._options = EchoResetOptions()
        self._seed = 0
        self._steps = 0
        self._total_length = 0
        self._history: deque[str] = deque(maxlen=HISTORY)

    def reset(
        self, *, seed: int | None, episode_id: str, options: EchoResetOptions | None
    ) -> Transition[EchoObservation]:
        self._options = options if options is not None else EchoResetOptions()
        self._seed = seed or 0
        self._steps = 0
        self._total_length = 0
        self._history.clear()
        greeting = self._options.greeting or "ready"
        return Transition(EchoObservation(echoed_message=greeting, message_length=len(greeting)))

    def step(self, action: EchoAction) -> Transition[EchoObservation]:
        message = action.message
        if len(message) > MAX_MESSAGE_CHARS:
            raise InvalidAction(
                f"message has {len(message)} characters; the limit is {MAX_MESSAGE_CHARS}"
            )
        self._steps += 1
        self._total_length += len(message)
        self._history.append(message)
        options = self._options
        return Transition(
            EchoObservation(echoed_message=message, message_length=len(message)),
            reward=0.1 * len(message),
            terminated=bool(options.stop_word) and message == options.stop_word,
            truncated=bool(options.max_steps) and self._steps >= options.max_steps,
        )

    def state(self) -> EchoState:
        return EchoState(
            total_length=self._total_length, seed=self._seed, history=list(self._history)
        )
