"""The ``openenv-grpc`` command: ``serve`` an environment, ``info`` about a server,
``console`` (a web page for a server), ``list``, ``init``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from google.protobuf import json_format

from openenv_grpc._version import __version__
from openenv_grpc.client.channel import tls_credentials
from openenv_grpc.client.errors import OpenEnvError
from openenv_grpc.client.info import fetch_info
from openenv_grpc.loader import available_envs, load_factory
from openenv_grpc.scaffold import add_init_command, run_init
from openenv_grpc.server.app import Door, serve
from openenv_grpc.server.config import ENV_VARS, ServerConfig, settings
from openenv_grpc.server.model.spec import EnvSpec
from openenv_grpc.server.process.logs import configure_logging

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="openenv-grpc", description="Reinforcement-learning environments over gRPC."
    )
    parser.add_argument("--version", action="version", version=f"openenv-grpc {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser(
        "serve",
        help="serve an environment until SIGTERM/SIGINT",
        description="Serve ENV. Each option falls back to its environment variable, then "
        "to its default. Token auth: set AUTH_TOKEN (and METRICS_TOKEN for /metrics) in "
        "the environment (never on the command line, where other users can read it).",
    )
    run.add_argument(
        "env", metavar="ENV", nargs="?", help="a packaged env (see `list`) or module:factory"
    )
    run.add_argument(
        "--openenv",
        metavar="MODULE:APP_OR_CLASS",
        help="serve an OpenEnv env unchanged instead of ENV (needs the openenv extra): "
        "its create_app module as uvicorn takes it (pkg.server.app:app: the env and models "
        "that call was given), or its Environment class or factory "
        "(server.my_environment:MyEnvironment); the current directory is importable",
    )
    for role in ("action", "observation", "state"):
        run.add_argument(
            f"--{role}",
            metavar="MODULE:MODEL",
            help=f"with --openenv: the env's {role.capitalize()} model (pydantic), where "
            "neither its app nor its class says it",
        )
    run.add_argument(
        "--openenv-port",
        type=int,
        metavar="PORT",
        help="also serve OpenEnv's client protocol (its /ws WebSocket, /health, /schema, "
        "/metadata) on this port of --host, for native and bridged envs alike: OpenEnv's "
        "own clients work unchanged, on the same sessions, capacity, auth and metrics as "
        "gRPC (needs the openenv extra); 0 = a free port (printed at start)",
    )
    for name, kind, meta, default in settings():
        if meta.flag is None:
            continue  # secrets stay off the command line
        shown = meta.shown_default.replace("`", "") or default
        run.add_argument(
            meta.flag,
            dest=name,
            type=kind,
            default=None,
            help=f"{meta.help.replace('`', '')} (env {meta.variable}; default {shown})",
        )

    info = commands.add_parser("info", help="print what a server's Info RPC returns")
    info.add_argument("target", metavar="TARGET", help="host:port")
    info.add_argument("--timeout", type=float, default=10.0, help="seconds to wait")
    info.add_argument(
        "--descriptors", action="store_true", help="include the FileDescriptorSet (long)"
    )
    _add_client_security(info)

    console = commands.add_parser(
        "console",
        help="a web page to watch and play a server's env (needs the console extra)",
        description="Serve a web console for the env server at TARGET: open sessions, "
        "reset, compose actions in forms made from the env's types, watch observations, "
        "capacity and steps/s. It is an ordinary gRPC client of TARGET.",
    )
    console.add_argument("target", metavar="TARGET", help="the env server, host:port")
    console.add_argument("--host", default="127.0.0.1", help="address of the web page")
    console.add_argument("--port", type=int, default=8080, help="port of the web page; 0 = free")
    _add_client_security(console)
    console.add_argument(
        "--connect-timeout", type=float, default=10.0, help="seconds to wait for TARGET at start"
    )
    console.add_argument(
        "--call-timeout",
        type=float,
        default=60.0,
        help="seconds to wait for one answer; 0 = no limit",
    )

    commands.add_parser("list", help="list the packaged environments")
    add_init_command(commands)
    return parser


def _add_client_security(parser: argparse.ArgumentParser) -> None:
    """The options of commands that talk to a server as a client: TLS and the token."""
    parser.add_argument("--ca", help="PEM CA file: connect with TLS, trusting this CA")
    parser.add_argument("--cert", help="PEM client certificate (mutual TLS)")
    parser.add_argument("--key", help="PEM client key (mutual TLS)")
    parser.add_argument("--token-env", default="AUTH_TOKEN", help="variable with the bearer token")


def _client_security(args: argparse.Namespace) -> tuple[grpc.ChannelCredentials | None, str | None]:
    """TLS credentials (None: plaintext) and the bearer token (None: none) from the options.

    Any of ``--ca``, ``--cert``, ``--key`` means TLS (without ``--ca``, the system's roots
    are trusted): a connection never falls back to plaintext because one was left out.

    Raises:
        OSError: a PEM file cannot be read.
        ValueError: ``--cert`` without ``--key`` or the reverse.
    """
    if bool(args.cert) != bool(args.key):
        raise ValueError("--cert and --key go together (a client certificate needs its key)")
    tls = args.ca or args.cert or args.key
    credentials = tls_credentials(args.ca, args.cert, args.key) if tls else None
    return credentials, os.environ.get(args.token_env) or None


def _serve(args: argparse.Namespace) -> int:
    fields = (name for name in ENV_VARS if hasattr(args, name))
    if (args.env is None) == (args.openenv is None):
        print(
            "openenv-grpc: serve takes ENV or --openenv MODULE:CLASS (one of them)", file=sys.stderr
        )
        return 2
    try:
        config = ServerConfig.from_env(**{name: getattr(args, name) for name in fields})
        configure_logging(config.log_level, config.log_format)
        if args.openenv is not None:
            factory, config = _openenv_factory(
                args.openenv, config, args.action, args.observation, args.state
            )
        elif args.action or args.observation or args.state:
            raise ValueError("--action, --observation and --state go with --openenv")
        else:
            factory = load_factory(args.env)
    except (ValueError, LookupError, TypeError, ImportError) as exc:
        print(f"openenv-grpc: {exc}", file=sys.stderr)
        return 2
    try:
        env_class = EnvSpec.from_factory(factory).env_class
    except TypeError as exc:
        print(f"openenv-grpc: {exc}", file=sys.stderr)
        return 1
    try:
        env_class.check_settings()  # a bad env setting is a usage error, like a bad flag
    except ValueError as exc:
        print(f"openenv-grpc: {exc}", file=sys.stderr)
        return 2
    try:
        doors = [] if args.openenv_port is None else [_openenv_door(args.openenv_port, config)]
        return serve(factory, config, doors=doors)
    except (TypeError, RuntimeError, ValueError, OSError, ImportError) as exc:
        print(f"openenv-grpc: {exc}", file=sys.stderr)
        return 1


def _openenv_factory(
    ref: str,
    config: ServerConfig,
    action: str | None = None,
    observation: str | None = None,
    state: str | None = None,
) -> tuple[Callable[[], Any], ServerConfig]:
    """The adapter class serving the OpenEnv env ``ref``, and ``config`` sized for it.

    Raises:
        ImportError: the openenv extra is not installed.
        LookupError: ``ref`` does not resolve. TypeError: it is no OpenEnv env.
        ValueError: a non-concurrent env with several workers.
    """
    from openenv_grpc.integrations.openenv_web_ui import leave_out_web_ui

    try:
        leave_out_web_ui()  # a gRPC server never serves it: seconds of imports saved
        from openenv_grpc.integrations.openenv.serving import adapter_for, serve_config
    except ImportError as exc:
        raise ImportError(
            f"--openenv needs its extra: pip install 'openenv-grpc[openenv]' ({exc})"
        ) from exc
    adapter = adapter_for(ref, action, observation, state)
    return adapter, serve_config(adapter, config)


def _openenv_door(port: int, config: ServerConfig) -> Door:
    """The OpenEnv door of ``--openenv-port PORT`` (served by this process, on its loop).

    Raises:
        ValueError: with --workers > 1 or TLS (refused, naming why), or a bad port.
        ImportError: the openenv extra is missing.
    """
    try:
        from openenv_grpc.integrations.openenv.door import door_for
    except ImportError as exc:
        raise ImportError(
            f"--openenv-port needs its extra: pip install 'openenv-grpc[openenv]' ({exc})"
        ) from exc
    return door_for(port, config)


def _info(args: argparse.Namespace) -> int:
    try:
        credentials, token = _client_security(args)
        info = fetch_info(args.target, timeout=args.timeout, credentials=credentials, token=token)
    except (OSError, ValueError) as exc:
        print(f"openenv-grpc: {exc}", file=sys.stderr)
        return 2
    except OpenEnvError as exc:
        print(f"openenv-grpc: {args.target}: {exc.code.name}: {exc.message}", file=sys.stderr)
        return 1
    if not args.descriptors:
        files = [file.name for file in info.descriptors.file]
        info.ClearField("descriptors")
    as_dict = json_format.MessageToDict(
        info, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    if not args.descriptors:
        as_dict["descriptor_files"] = files
    print(json.dumps(as_dict, indent=2))
    return 0


def _console(args: argparse.Namespace) -> int:
    try:
        from openenv_grpc.console import run_console
    except ImportError as exc:
        print(
            f"openenv-grpc: the console needs its extra: pip install 'openenv-grpc[console]' "
            f"({exc})",
            file=sys.stderr,
        )
        return 2
    try:
        configure_logging(
            os.environ.get("LOG_LEVEL") or "INFO", os.environ.get("LOG_FORMAT") or "text"
        )
        credentials, token = _client_security(args)
    except (OSError, ValueError) as exc:
        print(f"openenv-grpc: {exc}", file=sys.stderr)
        return 2
    return run_console(
        args.target,
        args.host,
        args.port,
        credentials=credentials,
        token=token,
        call_timeout=args.call_timeout or None,
        connect_timeout=args.connect_timeout,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "info":
        return _info(args)
    if args.command == "init":
        return run_init(args)
    if args.command == "console":
        return _console(args)
    for name in available_envs():
        print(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
