"""What a newcomer's first hour meets (issue 39), each papercut with its test: typed
messages and Gymnasium reset options whose errors name the field, the Gymnasium id forms
in a fresh interpreter, ``init`` with the kebab-case name the README shows, README
examples that print what their comments say, README figures that are dated or re-measured,
and install lines that name no package index."""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomllib
from google.protobuf.message import Message

from openenv_grpc.client.errors import InvalidRequest, PayloadTypeError
from openenv_grpc.scaffold import ScaffoldError, scaffold, validate_name
from openenv_grpc.server.config import ServerConfig
from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.echo import EchoAction, EchoResetOptions

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BIN = Path(sys.executable).parent
CATALOGUE = ["echo", "coding", "openspiel", "wordle", "gymnasium"]


@pytest.fixture(scope="module")
def gym_server() -> Iterator[ServerProcess]:
    process = ServerProcess("gymnasium", ["--max-concurrent-envs", "0"])
    yield process
    process.stop()


@pytest.fixture(scope="module")
def echo_server() -> Iterator[ServerProcess]:
    process = ServerProcess("echo", ["--max-concurrent-envs", "0"])
    yield process
    process.stop()


# -- constructor errors name the field --------------------------------------------------


def test_echo_action_names_message_type_field_value_and_what_it_takes() -> None:
    with pytest.raises(PayloadTypeError) as wrong_type:
        EchoAction(message=5)
    assert str(wrong_type.value) == ("INVALID_ARGUMENT: EchoAction.message takes a str, got int 5")
    assert isinstance(wrong_type.value, TypeError)  # what protobuf raised, still caught so
    with pytest.raises(PayloadTypeError, match=r"EchoResetOptions\.max_steps takes an int "
                       r">= 0 \(uint32\), got str 'ten'"):  # fmt: skip
        EchoResetOptions(max_steps="ten")
    with pytest.raises(InvalidRequest, match=r"max_steps .* got int -1 \(Value out of range"):
        EchoResetOptions(max_steps=-1)
    with pytest.raises(ValueError, match=r"EchoAction has no field 'mesage' \(its fields: "
                       r"message, list_tools, tool_call\)"):  # fmt: skip
        EchoAction(mesage="hello")
    assert EchoAction(message="hello").message == "hello"  # what works is unchanged


@pytest.mark.parametrize("env", CATALOGUE)
def test_every_catalogue_message_names_the_field_it_refuses(env: str) -> None:
    """Each typed client's four message classes, every field: a value of no type a field
    takes is refused naming the class and the field."""
    client = importlib.import_module(f"openenv_grpc_envs.{env}.client")
    classes: set[type[Message]] = set()
    for name in client.__all__:
        types = getattr(getattr(client, name), "_types", None)
        if types is None:
            continue  # not a session class
        classes.update(c for c in (types.action, types.observation, types.state,
                                   types.reset_options) if c is not None)  # fmt: skip
    assert len(classes) == 4, classes
    checked = 0
    for message_class in classes:
        for field in message_class.DESCRIPTOR.fields:
            with pytest.raises((PayloadTypeError, InvalidRequest)) as refused:
                message_class(**{field.name: object()})
            assert f"{message_class.__name__}.{field.name} takes " in str(refused.value)
            assert "got object <object object at" in str(refused.value)
            checked += 1
    assert checked >= 4


def test_classes_typed_from_info_name_the_field(echo_server: ServerProcess) -> None:
    """``described_session`` (the README's OpenEnv example) types a session from Info: its
    message classes, made at run time, name the field as the catalogue's do."""
    from openenv_grpc.integrations.openenv import described_session

    echo = described_session(echo_server.target)
    assert echo.Action is not EchoAction  # a class of its own, built from Info's descriptors
    with pytest.raises(PayloadTypeError, match=r"^INVALID_ARGUMENT: EchoAction\.message takes a "
                       r"str, got int 5$"):  # fmt: skip
        echo.Action(message=5)
    with echo(echo_server.target) as env:
        env.reset(seed=1, options=echo.ResetOptions(max_steps=3))
        assert env.step(echo.Action(message="hi")).observation.echoed_message == "hi"


# -- Gymnasium: reset options and ids ----------------------------------------------------


def test_gymnasium_reset_option_names_the_field_and_the_session_goes_on(
    gym_server: ServerProcess,
) -> None:
    from openenv_grpc_envs.gymnasium.adapters import RemoteGymnasiumEnv, RemoteGymnasiumVectorEnv

    named = r"GymnasiumResetOptions\.max_episode_steps takes an int >= 0 \(uint32\), got str 'ten'"
    with RemoteGymnasiumEnv(gym_server.target, "CartPole-v1") as env:
        with pytest.raises(PayloadTypeError, match=named):
            env.reset(options={"max_episode_steps": "ten"})
        with pytest.raises(PayloadTypeError, match=r"GymnasiumResetOptions\.env_id takes a str"):
            env.reset(options={"env_id": 5})
        with pytest.raises(PayloadTypeError, match=r"\.kwargs takes a dict of JSON-like"):
            env.reset(options={"kwargs": 3})
        env.reset(seed=0, options={"max_episode_steps": 10})  # the session goes on
        assert env.max_episode_steps == 10
        env.step(env.action_space.sample())
    with pytest.raises(PayloadTypeError, match=named):
        RemoteGymnasiumEnv(gym_server.target, "CartPole-v1", max_episode_steps="ten")
    with RemoteGymnasiumVectorEnv(gym_server.target, num_envs=2, env_id="CartPole-v1") as envs:
        with pytest.raises(PayloadTypeError, match=named):
            envs.reset(options={"max_episode_steps": "ten"})
        envs.reset(seed=0)
    gym_server.wait_until(lambda: gym_server.active() == 0, what="every session closed")


#: Run in a fresh interpreter: nothing of the adapters is imported before each form.
ID_FORMS = """
import sys
import gymnasium
target = sys.argv[1]
try:
    gymnasium.make("openenv-grpc/CartPole-v1", target=target)
    print("plain id without an import: made")
except gymnasium.error.NamespaceNotFound:
    print("plain id without an import: NamespaceNotFound")
module_form = "openenv_grpc_envs.gymnasium.adapters:openenv-grpc/CartPole-v1"
env = gymnasium.make(module_form, target=target)
obs, info = env.reset(seed=0)
env.step(env.action_space.sample())
print("module form:", env.spec.id, obs.shape)
env.close()
envs = gymnasium.make_vec(module_form, num_envs=2, target=target)
obs, infos = envs.reset(seed=0)
print("module form, make_vec:", obs.shape)
envs.close()
import openenv_grpc_envs.gymnasium.adapters as remote_envs
gymnasium.register_envs(remote_envs)
env = gymnasium.make("openenv-grpc/Remote-v0", target=target, env_id="Acrobot-v1")
obs, info = env.reset(seed=0)
print("after the import:", env.spec.id, obs.shape)
env.close()
"""


def test_gymnasium_id_forms_in_a_fresh_interpreter(gym_server: ServerProcess) -> None:
    run = subprocess.run(
        [sys.executable, "-c", ID_FORMS, gym_server.target],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines() == [
        "plain id without an import: NamespaceNotFound",  # as docs/training.md says
        "module form: openenv-grpc/CartPole-v1 (4,)",
        "module form, make_vec: (2, 4)",
        "after the import: openenv-grpc/Remote-v0 (6,)",
    ], run.stdout
    gym_server.wait_until(lambda: gym_server.active() == 0, what="every session closed")


# -- init takes the name the README shows ------------------------------------------------


def test_readme_name_is_one_init_takes() -> None:
    shown = re.search(r'^    name = "([^"]+)"$', README.read_text(), re.M)
    assert shown is not None
    validate_name(shown.group(1))  # "my-env": no ScaffoldError


def test_init_maps_a_kebab_name_to_a_snake_package(tmp_path: Path) -> None:
    project = scaffold("my-env", tmp_path)
    assert project == tmp_path / "my-env"
    assert 'name = "my-env"' in (project / "my_env" / "environment.py").read_text()
    pyproject = tomllib.loads((project / "pyproject.toml").read_text())
    assert pyproject["project"]["name"] == "my-env"
    assert pyproject["project"]["entry-points"]["openenv_grpc.envs"] == {
        "my-env": "my_env.environment:MyEnvEnvironment"
    }
    proto = (project / "proto" / "my_env" / "v1" / "my_env.proto").read_text()
    assert "package my_env.v1;" in proto
    assert '"openenv-grpc", "serve", "my-env"' in (project / "Dockerfile").read_text()
    assert "openenv-grpc serve my-env --port" in (project / "README.md").read_text()


@pytest.mark.parametrize("name", ["My-Env", "my--env", "9-lives", "my-env-", "my env", "my_-env"])
def test_init_refusal_says_what_names_are_allowed(tmp_path: Path, name: str) -> None:
    allowed = "use lower_snake_case or kebab-case, a letter first"
    with pytest.raises(ScaffoldError, match=allowed):
        validate_name(name)
    run = subprocess.run(
        [str(BIN / "openenv-grpc"), "init", name, "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert allowed in run.stderr and "'guess-game'" in run.stderr, run.stderr
    assert list(tmp_path.iterdir()) == []


def test_init_names_the_package_a_kebab_name_clashes_with(tmp_path: Path) -> None:
    with pytest.raises(ScaffoldError, match=r"'open-spiel' \(package 'open_spiel'\)"):
        validate_name("open-spiel")  # pyspiel's package is importable here


@pytest.mark.slow
@pytest.mark.fresh_server
@pytest.mark.timeout(300)
def test_kebab_project_generates_passes_its_tests_and_serves_by_name(tmp_path: Path) -> None:
    """The generated project, as docs/write-your-own-env.md runs it, with a kebab name:
    its code generated, its own tests passing, then installed and served by that name."""
    project = scaffold("my-env", tmp_path)
    path = os.pathsep.join([str(BIN), os.environ.get("PATH", "")])
    for command in (["make", "proto"], [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist"]):
        run = subprocess.run(
            command, cwd=project, env={**os.environ, "PATH": path},
            capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert run.returncode == 0, f"{command}:\n{run.stdout[-3000:]}{run.stderr[-3000:]}"
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
         "--no-build-isolation", "--target", str(site), str(project)],
        check=True, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    server = ServerProcess("my-env", pythonpath=[site])  # by its entry-point name
    try:
        assert server.info().env_name == "my-env"
    finally:
        server.stop()


# -- the README: examples print what they say, figures are dated or re-measured --------


def readme_examples() -> list[str]:
    """The README's Python blocks that use the echo env and print what a comment says."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    return [
        b for b in blocks
        if "from openenv_grpc_envs.echo import" in b and re.search(r"print\(.*\)\s+# ", b)
    ]  # fmt: skip


def test_readme_examples_print_what_their_comments_say(echo_server: ServerProcess) -> None:
    examples = readme_examples()
    assert len(examples) >= 2, "the tour and the vector example"
    for block in examples:
        expected = [
            line.split("# ", 1)[1].strip()
            for line in block.splitlines() if re.match(r"\s*print\(.*\)\s+# ", line)
        ]  # fmt: skip
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(block.replace("127.0.0.1:50051", echo_server.target), {})
        assert printed.getvalue().splitlines() == expected, block
    echo_server.wait_until(lambda: echo_server.active() == 0, what="every session closed")


#: A measured figure: a duration, a speed ratio, a count of what worked.
FIGURE = re.compile(
    r"\b\d+(?:[.,]\d+)?\s?(?:ms|s|min|minutes?|seconds?|h)\b(?!-)"
    r"|\b\d+ m \d+ s\b|~?\d+(?:\.\d+)?\u00d7|\b\d+ of the \d+\b"  # \u00d7: a times sign
)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def readme_figure_rechecked(figure: str) -> bool:
    """Figures that a command CI runs keeps true (each names its check)."""
    if figure == "1 ms":  # the default of --inline-threshold-ms, from the settings
        return ServerConfig().inline_threshold_ms == 1.0
    return False


def test_readme_figures_are_dated_or_rechecked() -> None:
    undated = []
    for paragraph in README.read_text().split("\n\n"):
        for match in FIGURE.finditer(paragraph):
            if not DATE.search(paragraph) and not readme_figure_rechecked(match.group()):
                undated.append(f"{match.group()!r} in: {paragraph[:120]!r}")
    assert not undated, "figures no command re-measures, with no date:\n" + "\n".join(undated)


# -- install lines ------------------------------------------------------------------------

#: An install line naming the project as a requirement, as if it were on an index.
FROM_AN_INDEX = re.compile(r"pip\s+install\s+(?:-\S+\s+)*[`'\"]*openenv-grpc\b")
#: Local install lines: a checkout (``-e '.[x]'``) or the wheel (``...whl[x]``).
LOCAL_EXTRAS = re.compile(r"pip\s+install\s+(?:-\S+\s+)*[`'\"]*(?:\.|\S+\.whl)\[([^\]]+)\]")


def user_docs() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md")), *sorted(ROOT.glob("envs/*/README.md"))]


def test_install_lines_name_no_index_and_only_real_extras() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = set(project["project"]["optional-dependencies"])
    promised, unknown, local = [], [], 0
    for path in user_docs():
        text = path.read_text()
        promised += [f"{path.relative_to(ROOT)}: {m.group()}" for m in FROM_AN_INDEX.finditer(text)]
        for match in LOCAL_EXTRAS.finditer(text):
            local += 1
            unknown += [e for e in match.group(1).split(",") if e.strip() not in extras]
    assert not promised, "install lines that need an index openenv-grpc is not on:\n" + "\n".join(
        promised
    )
    assert not unknown, f"extras named but not in pyproject.toml: {unknown}"
    assert local >= 10, "no local install line found: the pattern is wrong"
    assert "openenv_grpc-0.1.0-py3-none-any.whl[gymnasium]" in README.read_text()
    version = importlib.import_module("openenv_grpc._version").__version__
    assert version == "0.1.0", "the README names the wheel of this version: update it"
