"""The ``openenv-grpc`` command: ``serve`` an environment, ``info`` about a server,
``console`` (a web page for a server), ``list``, ``init``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import grpc
from google.protobuf import json_format

from openenv_grpc._version import __version__
from openenv_grpc.client.channel import tls_credentials
from openenv_grpc.client.info import fetch_info
from openenv_grpc.loader import available_envs, load_factory
from openenv_grpc.scaffold import add_init_command, run_init
from openenv_grpc.server.app import serve
from openenv_grpc.server.config import ENV_VARS, ServerConfig
from openenv_grpc.server.logs import configure_logging

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
    run.add_argument("env", metavar="ENV", help="a packaged env (see `list`) or module:factory")
    defaults = ServerConfig()

    def option(flag: str, field: str, kind: type, help_text: str) -> None:
        run.add_argument(
            flag,
            dest=field,
            type=kind,
            default=None,
            help=f"{help_text} (env {ENV_VARS[field]}; default {getattr(defaults, field)})",
        )

    option("--host", "host", str, "address to listen on")
    option("--port", "port", int, "port to listen on; 0 picks a free one")
    option("--max-concurrent-envs", "max_concurrent_envs", int, "session cap; 0 or -1 = unlimited")
    option("--idle-timeout", "idle_timeout", float, "seconds an idle session lives; 0 = forever")
    option("--grace", "grace_period", float, "seconds running sessions get on SIGTERM")
    option("--max-message-bytes", "max_message_bytes", int, "largest message in or out")
    option("--env-threads", "env_threads", int, "threads for blocking sync envs")
    option("--retry-pushback-ms", "retry_pushback_ms", int, "retry hint sent when full")
    option("--keepalive-time", "keepalive_time", float, "seconds between keepalive pings")
    option("--keepalive-timeout", "keepalive_timeout", float, "seconds to wait for a ping's answer")
    option("--step-timeout", "step_timeout", float, "seconds an env call may take; 0 = env's own")
    option("--tls-cert", "tls_cert", str, "PEM certificate chain: serve TLS")
    option("--tls-key", "tls_key", str, "PEM private key for --tls-cert")
    option("--tls-client-ca", "tls_client_ca", str, "PEM CA: require client certs (mTLS)")
    option("--metrics-port", "metrics_port", int, "Prometheus /metrics port; -1 off, 0 free")
    option("--metrics-host", "metrics_host", str, "address of the metrics endpoint")
    option(
        "--max-streams-per-connection", "max_streams_per_connection", int,
        "HTTP/2 streams one client connection may have open; 0 = capacity + 32",
    )  # fmt: skip
    option(
        "--max-pending-calls", "max_pending_calls", int,
        "calls gRPC holds before the handlers take them",
    )  # fmt: skip
    option("--workers", "workers", int, "server processes sharing the port (SO_REUSEPORT)")
    option("--isolated", "isolated", int, "run envs in this many worker processes; 0 = off")
    option("--reuse-port", "reuse_port", int, "1: share the port with other servers")
    run.add_argument("--log-level", default=None, help="logging level (env LOG_LEVEL; INFO)")
    run.add_argument(
        "--log-format", choices=["text", "json"], default=None,
        help="log lines as text or JSON (env LOG_FORMAT; default text)",
    )  # fmt: skip

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

    Raises:
        OSError: a PEM file cannot be read.
    """
    credentials = tls_credentials(args.ca, args.cert, args.key) if args.ca else None
    return credentials, os.environ.get(args.token_env) or None


def _serve(args: argparse.Namespace) -> int:
    try:
        configure_logging(
            args.log_level or os.environ.get("LOG_LEVEL") or "INFO",
            args.log_format or os.environ.get("LOG_FORMAT") or "text",
        )
    except ValueError as exc:
        print(f"openenv-grpc: {exc}", file=sys.stderr)
        return 2
    fields = (name for name in ENV_VARS if hasattr(args, name))
    try:
        config = ServerConfig.from_env(**{name: getattr(args, name) for name in fields})
        factory = load_factory(args.env)
    except (ValueError, LookupError) as exc:
        print(f"openenv-grpc: {exc}", file=sys.stderr)
        return 2
    try:
        return serve(factory, config)
    except (TypeError, RuntimeError, ValueError, OSError) as exc:
        print(f"openenv-grpc: {exc}", file=sys.stderr)
        return 1


def _info(args: argparse.Namespace) -> int:
    try:
        credentials, token = _client_security(args)
        info = fetch_info(args.target, timeout=args.timeout, credentials=credentials, token=token)
    except OSError as exc:
        print(f"openenv-grpc: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        print(f"openenv-grpc: {args.target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
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
