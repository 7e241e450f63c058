"""The coding env as a TRL environment: one tool, ``run_code``, checked by the row's
tests."""

from __future__ import annotations

from typing import Any

from openenv_grpc import StepResult
from openenv_grpc.integrations.trl.environment import SessionEnvironment
from openenv_grpc_envs.coding.v1.coding_pb2 import CodingAction, CodingObservation, Limit

__all__ = ["Coding"]


class Coding(SessionEnvironment):
    """Python in the coding env's sandbox. A dataset row's ``tests`` (a list of Python
    assertions, e.g. ``"assert add(2, 3) == 5"``) are run against every program: the
    reward of a run is the fraction that passed."""

    _tests: tuple[str, ...] = ()

    def reset(self, **row: Any) -> str | None:
        self._tests = tuple(str(test) for test in row.get("tests") or ())
        return super().reset(**row)

    async def run_code(self, code: str) -> str:
        """Run a Python program in a sandbox and see what it printed.

        Args:
            code: The complete Python program to run.

        Returns:
            The program's exit code, its standard output and standard error, and how
            many of the task's tests passed.
        """
        action = CodingAction(code=code)
        for i, assertion in enumerate(self._tests):
            action.tests.add(name=f"test_{i}", assertion=assertion)
        return await self._act(action)

    def _reset_text(self, result: StepResult[Any]) -> str | None:
        return None  # the task is in the prompt

    def _step_text(self, result: StepResult[Any]) -> str:
        observation: CodingObservation = result.observation
        parts = [f"exit code {observation.exit_code}"]
        if observation.limit not in (Limit.LIMIT_UNSPECIFIED, Limit.LIMIT_NONE):
            parts.append(f"stopped by a limit: {Limit.Name(observation.limit)}")
        parts.append(f"stdout:\n{observation.stdout}" if observation.stdout else "stdout: (empty)")
        if observation.stderr:
            parts.append(f"stderr:\n{observation.stderr}")
        if observation.tests:
            parts.append(f"tests passed: {observation.tests_passed}/{len(observation.tests)}")
            parts += [f"- {t.name}: {t.message}" for t in observation.tests if not t.passed]
        return "\n".join(parts)
