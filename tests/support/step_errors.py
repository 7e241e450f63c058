"""A native env that opts into OpenEnv's rule: an exception in ``step`` is an in-band
error and the episode goes on (``step_errors_end_episode = False``)."""

from __future__ import annotations

from openenv_grpc import Transition
from openenv_grpc_envs.echo import EchoAction, EchoEnvironment, EchoObservation


class ForgivingEchoEnv(EchoEnvironment):
    """The echo env; the message "raise" makes step raise."""

    step_errors_end_episode = False

    def step(self, action: EchoAction) -> Transition[EchoObservation]:
        if action.message == "raise":
            raise RuntimeError("boom in step")
        return super().step(action)


class StrictEchoEnv(ForgivingEchoEnv):
    """The same, with the default rule: the episode is over after the exception."""

    step_errors_end_episode = True
