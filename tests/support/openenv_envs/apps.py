"""The same envs served by OpenEnv's own ``create_app`` (as each env's server/app.py
does), for side-by-side tests: ``uvicorn support.openenv_envs.apps:echo_app``."""

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation

from support.openenv_envs.board import (
    BoardEnvironment,
    BoardObservation,
    BoardState,
    DropAction,
)
from support.openenv_envs.echo import EchoAction, EchoEnvironment, EchoObservation
from support.openenv_envs.mcp_echo import EchoMCPEnvironment
from support.openenv_envs.scored import ScoreAction, ScoreEnvironment, ScoreObservation
from support.openenv_envs.warehouse import (
    PickAction,
    PickObservation,
    WarehouseEnvironment,
    WarehouseState,
)

echo_app = create_app(
    EchoEnvironment, EchoAction, EchoObservation, env_name="echo", max_concurrent_envs=4
)
warehouse_app = create_app(
    WarehouseEnvironment,
    PickAction,
    PickObservation,
    env_name="warehouse",
    state_cls=WarehouseState,
)
mcp_echo_app = create_app(
    EchoMCPEnvironment,
    CallToolAction,
    CallToolObservation,
    env_name="echo_env",
    max_concurrent_envs=4,
)

# As connect4 / coding_env write theirs: the env's step names only the base classes, so
# the app is the one place that says the real ones.
board_app = create_app(
    BoardEnvironment, DropAction, BoardObservation, env_name="board", state_cls=BoardState
)

# Its step's reward is the action's score, None included; its reset gives none.
score_app = create_app(
    ScoreEnvironment, ScoreAction, ScoreObservation, env_name="score", max_concurrent_envs=4
)
