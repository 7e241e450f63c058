"""The echo environment: each step observes the action's message, rewarded by length.

It also shows the tool-calling pattern: an action may list the tools or call one, and
the observation carries the tool list or the call's result.
"""

from __future__ import annotations

from collections import deque

from google.protobuf import json_format

from openenv_grpc import Environment, InvalidAction, Transition
from openenv_grpc.tools import Toolbox, tool
from openenv_grpc_envs import snapshot_body
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
#: The layout of this env's snapshots (see :meth:`EchoEnvironment.snapshot`).
SNAPSHOT_LAYOUT = "echo/1"


class EchoEnvironment(Environment[EchoAction, EchoObservation, EchoState, EchoResetOptions]):
    """Echoes each message back; reward is 0.1 per character."""

    name = "echo"
    version = "1.1.0"
    description = "Echoes each message back; reward is 0.1 per character. Offers tools."
    runs_inline = True  # pure bookkeeping: microseconds per call

    def __init__(self) -> None:
        self._options = EchoResetOptions()
        self._seed = 0
        self._steps = 0
        self._total_length = 0
        self._history: deque[str] = deque(maxlen=HISTORY)
        self._toolbox = Toolbox(self)

    def reset(
        self, *, seed: int | None, episode_id: str, options: EchoResetOptions | None
    ) -> Transition[EchoObservation]:
        self._options = options if options is not None else EchoResetOptions()
        self._seed = seed or 0
        self._steps = 0
        self._total_length = 0
        self._history.clear()
        greeting = self._options.greeting or "ready"
        observation = EchoObservation(echoed_message=greeting, message_length=len(greeting))
        observation.tools.CopyFrom(self._toolbox.list())
        return Transition(observation)

    def step(self, action: EchoAction) -> Transition[EchoObservation]:
        kind = action.WhichOneof("kind")
        if kind == "list_tools":
            observation = EchoObservation()
            observation.tools.CopyFrom(self._toolbox.list())
            return self._advance(observation, reward=0.0, message=None)
        if kind == "tool_call":
            result = self._toolbox.call(action.tool_call)  # InvalidAction on a bad call
            observation = EchoObservation()
            observation.tool_result.CopyFrom(result)
            return self._advance(observation, reward=0.0, message=None)
        message = action.message
        _check_length(message)
        observation = EchoObservation(echoed_message=message, message_length=len(message))
        return self._advance(observation, reward=0.1 * len(message), message=message)

    def _advance(
        self, observation: EchoObservation, *, reward: float, message: str | None
    ) -> Transition[EchoObservation]:
        """Count the step, record the message, and apply the episode's end rules."""
        self._steps += 1
        if message is not None:
            self._total_length += len(message)
            self._history.append(message)
        options = self._options
        return Transition(
            observation,
            reward=reward,
            terminated=bool(options.stop_word) and message == options.stop_word,
            truncated=bool(options.max_steps) and self._steps >= options.max_steps,
        )

    def state(self) -> EchoState:
        return EchoState(
            total_length=self._total_length, seed=self._seed, history=list(self._history)
        )

    def snapshot(self) -> bytes:
        """The episode as JSON: reset options, seed, step count, total length and history
        (at most 100 messages of at most 64 Ki characters each)."""
        return snapshot_body.dump(
            SNAPSHOT_LAYOUT,
            {
                "options": json_format.MessageToDict(self._options),
                "seed": self._seed,
                "steps": self._steps,
                "total_length": self._total_length,
                "history": list(self._history),
            },
        )

    def restore(self, snapshot: bytes) -> None:
        """Continue from :meth:`snapshot`'s bytes.

        Raises:
            InvalidAction: a field is missing, of the wrong type or out of bounds (the
                episode is unchanged).
        """
        body = snapshot_body.load(SNAPSHOT_LAYOUT, snapshot)
        try:
            options = json_format.ParseDict(body.mapping("options"), EchoResetOptions())
        except json_format.ParseError as exc:
            raise body.invalid("options", f"is not an EchoResetOptions: {exc}") from None
        seed = body.integer("seed", low=0, high=snapshot_body.MAX_SEED)
        steps = body.integer("steps", low=0)
        total_length = body.integer("total_length", low=0)
        history = body.strings("history", max_items=HISTORY)
        for message in history:
            _check_length(message)
        # Everything checked: commit.
        self._options, self._seed, self._steps = options, seed, steps
        self._total_length = total_length
        self._history = deque(history, maxlen=HISTORY)

    # -- tools: the same abilities, called the way an LLM agent calls functions -----------

    @tool
    def reverse(self, message: str) -> str:
        """Return the message reversed."""
        _check_length(message)
        return message[::-1]

    @tool
    def count(self, message: str, letter: str) -> int:
        """Count how often a letter occurs in the message."""
        if len(letter) != 1:
            raise ValueError(f"letter must be one character, got {len(letter)}")
        return message.count(letter)

    @tool
    def history(self, last: int = 5) -> list[str]:
        """The last messages echoed in this episode, oldest first."""
        return list(self._history)[-last:] if last > 0 else []


def _check_length(message: str) -> None:
    if len(message) > MAX_MESSAGE_CHARS:
        raise InvalidAction(
            f"message has {len(message)} characters; the limit is {MAX_MESSAGE_CHARS}"
        )
