"""A bench env: the echo of plain messages in a form that batches by itself, so that a
vector stream of N envs is one action message and one observation message each way, with
no ``Any`` per env (``EchoBatchAction.messages`` / ``EchoBatchObservation``): what the
protocol costs per env-step when the env costs next to nothing.

``openenv-grpc serve openenv_grpc_envs.echo.batch:EchoBatchEnvironment``. Each env echoes
as the echo env does for a message action (reward 0.1 per character, ``max_steps``
truncates, ``stop_word`` terminates, the greeting after a reset, the same ``EchoState``);
it has no tools and no snapshots. Echo's own messages and env are not touched: this env
has messages of its own. The batch (:class:`EchoBatch`) keeps its envs as columns, so a
row costs a few list operations, and does the autoreset of its mode.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from openenv_grpc import (
    AutoresetMode,
    BatchEnvironment,
    BatchTransition,
    Environment,
    InvalidAction,
    Transition,
    VectorSession,
)
from openenv_grpc_envs.echo.environment import HISTORY, MAX_MESSAGE_CHARS
from openenv_grpc_envs.echo.v1.echo_batch_pb2 import EchoBatchAction, EchoBatchObservation
from openenv_grpc_envs.echo.v1.echo_pb2 import EchoResetOptions, EchoState

__all__ = ["EchoBatch", "EchoBatchEnvironment", "EchoBatchVectorEnv"]


class EchoBatch(
    BatchEnvironment[EchoBatchAction, EchoBatchObservation, EchoState, EchoResetOptions]
):
    """``size`` envs of :class:`EchoBatchEnvironment` as columns; see the module docstring."""

    def __init__(self, size: int, autoreset: AutoresetMode) -> None:
        super().__init__(size, autoreset)
        #: Per env: (max_steps, stop_word, greeting) of its last reset; autoresets keep them.
        self._limits: list[tuple[int, str, str]] = [(0, "", "ready")] * size
        self._seeds = [0] * size
        self._steps = [0] * size
        self._totals = [0] * size
        self._history: list[deque[str]] = [deque(maxlen=HISTORY) for _ in range(size)]
        #: Per env: its episode ended at its last step (NEXT_STEP resets it at the next).
        self._ended = [False] * size
        #: The envs whose options can end an episode (a step limit or a stop word).
        self._limited: set[int] = set()

    def reset(
        self,
        indices: Sequence[int],
        seeds: Sequence[int | None],
        options: Sequence[EchoResetOptions | None],
    ) -> BatchTransition[EchoBatchObservation]:
        greetings = []
        for index, seed, option in zip(indices, seeds, options, strict=True):
            given = option if option is not None else EchoResetOptions()
            self._limits[index] = (given.max_steps, given.stop_word, given.greeting or "ready")
            if given.max_steps or given.stop_word:
                self._limited.add(index)
            else:
                self._limited.discard(index)
            greetings.append(self._restart(index))
            self._seeds[index] = seed or 0
        count = len(indices)
        return BatchTransition(_observation(greetings), [0.0] * count, [False] * count,
                               [False] * count)  # fmt: skip

    def _restart(self, index: int) -> str:
        """A new episode in env ``index`` with its last options, unseeded (as an autoreset
        starts it); returns its greeting."""
        self._seeds[index] = 0
        self._steps[index] = 0
        self._totals[index] = 0
        self._history[index].clear()
        self._ended[index] = False
        return self._limits[index][2]

    def step(
        self, indices: Sequence[int], actions: EchoBatchAction
    ) -> BatchTransition[EchoBatchObservation]:
        messages = actions.messages
        if len(messages) != len(indices):
            raise InvalidAction(
                f"{len(messages)} messages for {len(indices)} envs: give one per env named, "
                "in index order"
            )
        if not self._limited and True not in self._ended:
            # No env named can end its episode now (no limits, no autoreset due): the
            # rows are the columns as they came, the books three list operations each.
            given = list(messages)
            lengths = list(map(len, given))
            if not lengths or max(lengths) <= MAX_MESSAGE_CHARS:
                steps, totals, history = self._steps, self._totals, self._history
                for index, message, length in zip(indices, given, lengths, strict=True):
                    steps[index] += 1
                    totals[index] += length
                    history[index].append(message)
                flags = [False] * len(given)
                observation = EchoBatchObservation(echoed_messages=given, message_lengths=lengths)
                return BatchTransition(observation, [0.1 * n for n in lengths], flags, flags)
        echoed: list[str] = []
        rewards: list[float] = []
        terminated: list[bool] = []
        truncated: list[bool] = []
        marks: list[bool] = []
        finals: list[str] = []
        errors: dict[int, Exception] = {}
        limits, steps, totals, history = self._limits, self._steps, self._totals, self._history
        ended = self._ended
        next_step = self.autoreset is AutoresetMode.NEXT_STEP
        same_step = self.autoreset is AutoresetMode.SAME_STEP
        for index, message in zip(indices, messages, strict=True):
            if next_step and ended[index]:  # the step after an episode's end resets it
                echoed.append(self._restart(index))
                rewards.append(0.0)
                terminated.append(False)
                truncated.append(False)
                marks.append(True)
                continue
            length = len(message)
            if length > MAX_MESSAGE_CHARS:  # refused: this env's episode goes on
                errors[index] = InvalidAction(
                    f"message has {length} characters; the limit is {MAX_MESSAGE_CHARS}"
                )
                continue
            count = steps[index] = steps[index] + 1
            totals[index] += length
            history[index].append(message)
            max_steps, stop_word, _ = limits[index]
            term = bool(stop_word) and message == stop_word
            trunc = bool(max_steps) and count >= max_steps
            rewards.append(0.1 * length)
            terminated.append(term)
            truncated.append(trunc)
            if same_step and (term or trunc):  # reset at once; the last echo is the final
                finals.append(message)
                echoed.append(self._restart(index))
                marks.append(True)
            else:
                echoed.append(message)
                marks.append(False)
                ended[index] = term or trunc
        return BatchTransition(
            _observation(echoed), rewards, terminated, truncated,
            reset=marks if True in marks else None,
            final_observation=_observation(finals) if finals else None,
            final_infos=[None] * len(finals) if finals else None,
            errors=errors or None,
        )  # fmt: skip

    def state(self, index: int) -> EchoState:
        return EchoState(
            total_length=self._totals[index],
            seed=self._seeds[index],
            history=list(self._history[index]),
        )

    def join_actions(self, actions: Sequence[EchoBatchAction]) -> EchoBatchAction:
        for k, action in enumerate(actions):
            if len(action.messages) != 1:
                raise InvalidAction(
                    f"action {k} has {len(action.messages)} messages: one env's action has one"
                )
        return EchoBatchAction(messages=[action.messages[0] for action in actions])

    def split_observation(
        self, observation: EchoBatchObservation, rows: int
    ) -> list[EchoBatchObservation]:
        return [_observation([message]) for message in observation.echoed_messages[:rows]]


class EchoBatchEnvironment(
    Environment[EchoBatchAction, EchoBatchObservation, EchoState, EchoResetOptions]
):
    """One env of the echo bench env (a one-row :class:`EchoBatch`); vector streams get
    its native batch."""

    name = "echo_batch"
    version = "1.0.0"
    description = "Echoes each row's message back, as one message for all rows (a bench env)."
    runs_inline = True  # list bookkeeping: microseconds per call

    def __init__(self) -> None:
        # The server refuses a step after an episode's end; no autoreset for one env.
        self._one = EchoBatch(1, AutoresetMode.DISABLED)

    def reset(
        self, *, seed: int | None, episode_id: str, options: EchoResetOptions | None
    ) -> Transition[EchoBatchObservation]:
        return Transition(self._one.reset([0], [seed], [options]).observation)

    def step(self, action: EchoBatchAction) -> Transition[EchoBatchObservation]:
        if len(action.messages) != 1:
            raise InvalidAction(
                f"{len(action.messages)} messages: one env's action has exactly one"
            )
        answer = self._one.step([0], action)
        if answer.errors:
            raise answer.errors[0]
        return Transition(
            answer.observation,
            reward=answer.rewards[0],
            terminated=answer.terminated[0],
            truncated=answer.truncated[0],
        )

    def state(self) -> EchoState:
        return self._one.state(0)

    @classmethod
    def make_batch(cls, size: int, autoreset: AutoresetMode) -> EchoBatch:
        return EchoBatch(size, autoreset)


class EchoBatchVectorEnv(
    VectorSession[EchoBatchAction, EchoBatchObservation, EchoState, EchoResetOptions]
):
    """N envs of the echo bench env on one stream: ``envs.step_batch(EchoBatchAction(
    messages=[...]))`` (one message per env) returns one observation for all."""


def _observation(messages: list[str]) -> EchoBatchObservation:
    return EchoBatchObservation(
        echoed_messages=messages, message_lengths=[len(m) for m in messages]
    )
