"""An env's server/app.py that builds OpenEnv's web UI itself, as some envs' do (no
ENABLE_WEB_INTERFACE check): the UI must then be there for the app to import."""

from openenv.core.env_server import create_web_interface_app

from support.openenv_envs.echo import EchoAction, EchoObservation
from support.openenv_envs.modules import LoadedModulesEnvironment

app = create_web_interface_app(
    LoadedModulesEnvironment, EchoAction, EchoObservation, env_name="modules"
)
