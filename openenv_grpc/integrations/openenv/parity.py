"""The same episode on OpenEnv's own server and on openenv-grpc, answer for answer.

For a migration check (and ``bench/openenv_catalogue.py``, and the tests): play one
reset and a list of actions, written as OpenEnv's JSON, against OpenEnv's server (its
``GenericEnvClient`` over the WebSocket) and against an openenv-grpc server (the
described client, typed from Info), and return both as OpenEnv's JSON shows them::

    theirs = openenv_episode("http://127.0.0.1:8000", {"seed": 3}, actions)
    ours = grpc_episode(adapter, "127.0.0.1:50051", {"seed": 3}, actions)
    assert differences(ours, theirs) == []

Each answer is ``{"observation": ..., "reward": ..., "done": ...}`` (the observation as
``model_dump()`` without reward and done, metadata included, as OpenEnv's
``serialize_observation`` writes it) or ``{"error": "..."}`` for a refused step; the
episode goes on after an error, as on both servers. Values are compared as JSON text,
so ``1`` and ``1.0`` differ.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from openenv_grpc.integrations.openenv.convert import from_data, jsonable, to_message, to_python
from openenv_grpc.integrations.openenv.schema import ModelPlan, UnionPlan

__all__ = ["compared", "differences", "grpc_episode", "openenv_episode"]

Answer = dict[str, Any]


def openenv_episode(
    base_url: str, reset: dict[str, Any], actions: Sequence[dict[str, Any]]
) -> list[Answer]:
    """The episode on OpenEnv's server at ``base_url`` (``GenericEnvClient``)."""
    from openenv.core.generic_client import GenericEnvClient

    answers: list[Answer] = []
    with GenericEnvClient(base_url=base_url).sync() as client:
        answers.append(_theirs(lambda: client.reset(**reset)))
        for action in actions:
            answers.append(_theirs(lambda action=action: client.step(action)))
    return answers


def _theirs(call: Any) -> Answer:
    try:
        result = call()
    except Exception as exc:  # an in-band error: the episode goes on
        return {"error": str(exc)}
    return {"observation": result.observation, "reward": result.reward, "done": result.done}


def grpc_episode(
    adapter: type[Any],
    target: str,
    reset: dict[str, Any],
    actions: Sequence[dict[str, Any]],
    token: str | None = None,
) -> list[Answer]:
    """The episode on the openenv-grpc server at ``target`` serving ``adapter`` (the
    adapter class made in this process, which turns OpenEnv's JSON into messages and the
    answers back into the env's own models)."""
    from openenv_grpc import EnvError, SessionRefused
    from openenv_grpc.integrations.openenv.client import described_session

    bridge = adapter._bridge
    Env = described_session(target, token=token)
    answers: list[Answer] = []
    env = Env(target, token=token)
    try:
        env.open()
    except SessionRefused as exc:  # the env could not be made: every call fails, as there
        return [{"error": exc.message}] * (1 + len(actions))
    with env:
        try:
            options = _options(bridge, {k: v for k, v in reset.items() if k != "seed"})
            result = env.reset(
                seed=reset.get("seed"),
                options=None if options is None else Env.ResetOptions.FromString(options),
            )
            answers.append(_ours(bridge.observation, result))
        except EnvError as exc:
            answers.append({"error": exc.message})
        for action in actions:
            try:
                message = to_message(bridge.action, _action_model(bridge.action, action))
                result = env.step(Env.Action.FromString(message.SerializeToString()))
                answers.append(_ours(bridge.observation, result))
            except (EnvError, ValidationError, ValueError) as exc:
                answers.append({"error": getattr(exc, "message", None) or str(exc)})
    return answers


def _options(bridge: Any, extra: dict[str, Any]) -> bytes | None:
    if not extra:
        return None
    named = {f.name for f in bridge.options.fields}
    data = {k: v for k, v in extra.items() if k in named}
    rest = {k: v for k, v in extra.items() if k not in named}
    if rest and bridge.kwargs_field is not None:
        data[bridge.kwargs_field] = rest
    return from_data(bridge.options, data).SerializeToString()


def _action_model(plan: ModelPlan | UnionPlan, action: dict[str, Any]) -> BaseModel:
    """OpenEnv's action JSON as the model the env's server would validate it into."""
    if isinstance(plan, ModelPlan):
        return plan.python.model_validate(action)
    error: ValidationError | None = None
    for _, member in plan.members:
        try:
            return member.python.model_validate(action)
        except ValidationError as exc:
            error = error or exc
    assert error is not None
    raise error


def _ours(plan: ModelPlan | UnionPlan, result: Any) -> Answer:
    model, data = to_python(plan, result.observation)
    observation = model.model_validate(data).model_dump(exclude={"reward", "done"})
    reward = None if result.no_reward else result.reward  # the env's None, as OpenEnv's
    return {"observation": observation, "reward": reward, "done": result.terminated}


def differences(ours: Sequence[Answer], theirs: Sequence[Answer]) -> list[str]:
    """Where the two episodes differ (empty: the same answers). Rewards compare as
    numbers (``1`` equals ``1.0``), a None (no reward) only with a None; errors compare by
    presence (the two servers word them differently). Once both said ``done``, the rest
    is not compared: stepping after ``done`` is refused here and passed to the env by
    OpenEnv (a documented difference); :func:`compared` says how many were."""
    found: list[str] = []
    if len(ours) != len(theirs):
        found.append(f"{len(ours)} answers here, {len(theirs)} from OpenEnv")
    for index, (mine, other) in enumerate(zip(ours, theirs, strict=False)):
        if index >= compared(ours, theirs):
            break
        if ("error" in mine) != ("error" in other):
            found.append(f"answer {index}: {_brief(mine)} here, {_brief(other)} from OpenEnv")
            continue
        if "error" in mine:
            continue
        for key in ("observation", "done"):
            if _text(mine[key]) != _text(other[key]):
                found.append(
                    f"answer {index} {key}: {_text(mine[key])[:300]} here, "
                    f"{_text(other[key])[:300]} from OpenEnv"
                )
        if _reward(mine["reward"]) != _reward(other["reward"]):
            found.append(f"answer {index} reward: {mine['reward']} here, {other['reward']}")
    return found


def _reward(value: Any) -> float | None:
    return None if value is None else float(value)


def compared(ours: Sequence[Answer], theirs: Sequence[Answer]) -> int:
    """How many answers :func:`differences` compares: up to the first that is ``done``
    on both servers, inclusive."""
    for index, (mine, other) in enumerate(zip(ours, theirs, strict=False)):
        if mine.get("done") and other.get("done"):
            return index + 1
    return min(len(ours), len(theirs))


def _brief(answer: Answer) -> str:
    return f"error {answer['error'][:200]!r}" if "error" in answer else "an observation"


def _text(value: Any) -> str:
    return json.dumps(jsonable(value), sort_keys=True, default=repr)
