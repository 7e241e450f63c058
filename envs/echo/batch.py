"""The echo env's native batch: a vector stream's N echo envs in one object, one action
message and one observation message for all rows (``EchoAction.rows`` /
``EchoObservation.rows``), no ``Any`` per env -- the protocol's floor per env-step.

``EchoBatchEnvironment`` is the echo env with that batch (``openenv-grpc serve
openenv_grpc_envs.echo:EchoBatchEnvironment``); the plain ``EchoEnvironment`` keeps the
server's loop over instances. Each row behaves exactly as one ``EchoEnvironment`` (the
same rewards, episode ends, tools, states and snapshots: each row *is* one); the batch
adds the autoreset of its mode.
"""

from __future__ import annotations

from collections.abc import Sequence

from openenv_grpc import AutoresetMode, BatchEnvironment, BatchTransition, InvalidAction
from openenv_grpc_envs.echo.environment import EchoEnvironment
from openenv_grpc_envs.echo.v1.echo_pb2 import (
    EchoAction,
    EchoObservation,
    EchoResetOptions,
    EchoState,
)

__all__ = ["EchoBatch", "EchoBatchEnvironment"]


class EchoBatch(BatchEnvironment[EchoAction, EchoObservation, EchoState, EchoResetOptions]):
    """``size`` echo envs answered together; see the module docstring."""

    def __init__(self, size: int, autoreset: AutoresetMode) -> None:
        super().__init__(size, autoreset)
        self._envs = [EchoEnvironment() for _ in range(size)]
        #: Each env's last reset options: an autoreset starts the next episode with them.
        self._options: list[EchoResetOptions | None] = [None] * size
        #: Each env's episode ended at its last step (NEXT_STEP resets it at the next).
        self._ended = [False] * size

    def reset(
        self,
        indices: Sequence[int],
        seeds: Sequence[int | None],
        options: Sequence[EchoResetOptions | None],
    ) -> BatchTransition[EchoObservation]:
        out = EchoObservation()
        rows = out.rows
        envs, kept, ended = self._envs, self._options, self._ended
        for index, seed, option in zip(indices, seeds, options, strict=True):
            rows.append(envs[index].reset(seed=seed, episode_id="", options=option).observation)
            kept[index] = option
            ended[index] = False
        count = len(indices)
        return BatchTransition(out, [0.0] * count, [False] * count, [False] * count)

    def step(self, indices: Sequence[int], actions: EchoAction) -> BatchTransition[EchoObservation]:
        actions_rows = actions.rows
        if len(actions_rows) != len(indices):
            raise InvalidAction(
                f"{len(actions_rows)} action rows for {len(indices)} envs: give one row per "
                "env named, in index order"
            )
        out = EchoObservation()
        rows = out.rows
        rewards: list[float] = []
        terminated: list[bool] = []
        truncated: list[bool] = []
        marks: list[bool] = []
        finals = EchoObservation()
        errors: dict[int, Exception] = {}
        envs, kept, ended = self._envs, self._options, self._ended
        mode = self.autoreset
        next_step, same_step = mode is AutoresetMode.NEXT_STEP, mode is AutoresetMode.SAME_STEP
        for index, action in zip(indices, actions_rows, strict=True):
            env = envs[index]
            if next_step and ended[index]:  # the step after an episode's end resets it
                rows.append(env.reset(seed=None, episode_id="", options=kept[index]).observation)
                rewards.append(0.0)
                terminated.append(False)
                truncated.append(False)
                marks.append(True)
                ended[index] = False
                continue
            try:
                transition = env.step(action)
            except Exception as exc:  # InvalidAction: refused, episode goes on; else broken
                errors[index] = exc
                continue
            done = transition.terminated or transition.truncated
            if same_step and done:  # reset at once; the ended episode's last observation
                finals.rows.append(transition.observation)
                first = env.reset(seed=None, episode_id="", options=kept[index])
                rows.append(first.observation)
                marks.append(True)
            else:
                rows.append(transition.observation)
                marks.append(False)
                ended[index] = done
            rewards.append(transition.reward)
            terminated.append(transition.terminated)
            truncated.append(transition.truncated)
        return BatchTransition(
            out, rewards, terminated, truncated,
            reset=marks if True in marks else None,
            final_observation=finals if finals.rows else None,
            final_infos=[None] * len(finals.rows) if finals.rows else None,
            errors=errors or None,
        )  # fmt: skip

    def state(self, index: int) -> EchoState:
        return self._envs[index].state()

    def snapshot(self, index: int) -> bytes:
        return self._envs[index].snapshot()

    def restore(self, index: int, snapshot: bytes, *, ended: bool) -> None:
        env = self._envs[index]
        env.restore(snapshot)
        self._options[index] = env._options  # its autoresets start with the restored options
        self._ended[index] = ended and self.autoreset is AutoresetMode.NEXT_STEP

    def join_actions(self, actions: Sequence[EchoAction]) -> EchoAction:
        return EchoAction(rows=actions)

    def split_observation(self, observation: EchoObservation, rows: int) -> list[EchoObservation]:
        return list(observation.rows)


class EchoBatchEnvironment(EchoEnvironment):
    """The echo env, answering vector streams with its native batch (:class:`EchoBatch`)."""

    @classmethod
    def make_batch(cls, size: int, autoreset: AutoresetMode) -> EchoBatch:
        return EchoBatch(size, autoreset)
