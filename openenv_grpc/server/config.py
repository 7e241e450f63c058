"""Server settings, each declared once with :func:`setting`: its default, range and help
(its variable and flag follow its name). The ``serve`` options, :meth:`ServerConfig.from_env`
and docs/settings.md are all made from these declarations. Precedence: argument, then
variable, then default.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar, cast

__all__ = ["ENV_VARS", "STREAM_HEADROOM", "ServerConfig", "Setting", "settings", "settings_table"]

T = TypeVar("T")

_INT32_MAX = 2**31 - 1
_KINDS: dict[str, type] = {"int": int, "float": float, "str": str}
#: Streams a connection gets beyond the session capacity: room for Info, health and
#: reflection, and for refused opens, while one connection holds every session.
STREAM_HEADROOM = 32
#: Bytes of a message's room a snapshot leaves for the envelope around it.
SNAPSHOT_MARGIN = 1024
#: The request limit when none is set: gRPC's own default receive limit.
DEFAULT_REQUEST_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Setting:
    """Everything about one setting but its name and type. ``variable`` and ``flag`` follow
    the name (``max_held_bytes``: ``MAX_HELD_BYTES``, ``--max-held-bytes``) unless given; a
    ``secret`` has no flag, so it stays off the command line; ``above`` is an exclusive
    minimum; ``shown_default`` is how the docs show a computed default; ``details`` adds
    to ``help`` in the docs' table."""

    help: str
    variable: str = ""
    flag: str | None = ""
    minimum: float | None = None
    above: float | None = None
    maximum: float | None = None
    choices: tuple[Any, ...] = ()
    shown_default: str = ""
    details: str = ""
    secret: bool = False


def setting(default: T | None = None, *, factory: Callable[[], T] | None = None, **meta: Any) -> T:
    """Declare a :class:`ServerConfig` field: its default (or ``factory``) and its
    :class:`Setting`."""
    spec = Setting(**meta)
    metadata = {"setting": spec}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata, repr=not spec.secret)
    return cast(T, field(default=default, metadata=metadata, repr=not spec.secret))


def _default_threads() -> int:
    return min(32, (os.cpu_count() or 1) + 4)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """How a server listens, admits sessions and reclaims them (docs/settings.md)."""

    host: str = setting("127.0.0.1", help="listen address (`0.0.0.0` / `[::]` in containers)")
    port: int = setting(
        50051, minimum=0, maximum=65535, help="port; `0` picks a free one (printed at start)",
    )  # fmt: skip
    max_concurrent_envs: int = setting(
        1024,
        help="sessions (= env instances) per server process; `0` or `-1` (any number "
        "below 1) = unlimited",
    )  # fmt: skip
    max_vector_envs: int = setting(
        1024, minimum=1,
        help="most envs one VectorSession stream may hold (its `openenv-num-envs`)",
        details="a larger N is refused with `INVALID_ARGUMENT` before admission; each env "
        "of a vector stream also takes one of the `MAX_CONCURRENT_ENVS` slots, all or "
        "nothing (`RESOURCE_EXHAUSTED` names N and the free slots)",
    )  # fmt: skip
    max_vector_in_flight: int = setting(
        4, minimum=1, maximum=1024,
        help="most requests one VectorSession stream may have in flight at once (each on "
        "envs of its own, answered as each completes)",
        details="a request past it is answered in-band `RESOURCE_EXHAUSTED` naming this "
        "setting and nothing is done; the stream goes on. A request naming an env that a "
        "request in flight names is refused `FAILED_PRECONDITION`. Session streams answer "
        "one request at a time",
    )  # fmt: skip
    idle_timeout: float = setting(
        600.0, minimum=0,
        help="seconds a session may wait for its client before the server closes it; "
        "`0` = forever",
    )  # fmt: skip
    request_arrival_timeout: float = setting(
        10.0, above=0,
        help="seconds the request of a unary call (Info, health Check and Watch) may take to "
        "arrive (at most 1 s for a caller without a valid token)",
        details="grpc.aio reads such a request whole before answering, so a client that "
        "never sends its last bytes would hold up to `--max-message-bytes` for as long as "
        "it kept the connection; past this the call ends `DEADLINE_EXCEEDED` and what "
        "arrived is let go. A probe's request takes microseconds. Session and "
        "VectorSession streams have `--idle-timeout` instead",
    )  # fmt: skip
    grace_period: float = setting(
        25.0, flag="--grace", minimum=0, help="seconds running sessions get after SIGTERM/SIGINT",
        details="each is told at once (a `DRAINING` notice with the seconds left). Then the "
        "sessions still open end (`UNAVAILABLE`) and their envs get 2 s to close; an env "
        "stuck in a call or in `close()` after that is abandoned (logged; its thread cannot "
        "be stopped) and the process exits 0 anyway: at most grace + 3 s after the signal",
    )  # fmt: skip
    max_message_bytes: int = setting(
        16 * 1024 * 1024, minimum=1,
        help="largest message out, and the ceiling of `--max-request-bytes`",
        details="a larger response (a huge observation, info or state) is replaced by an "
        "in-band `RESOURCE_EXHAUSTED` error naming the limit and the session goes on",
    )  # fmt: skip
    max_request_bytes: int = setting(
        0, minimum=0,
        shown_default="`0` (4 MiB, or the snapshot limit + 1 KiB if larger: 8 MiB + 1 KiB)",
        help="largest request a client may send; never above `--max-message-bytes`",
        details="a larger request ends its stream (`RESOURCE_EXHAUSTED`) as soon as its "
        "length prefix arrives. gRPC buffers a request until it is complete, so a client "
        "that sends all of one but the last bytes pins up to this much per stream (until "
        "the idle timeout or the connection ends); the snapshot limit in force is kept "
        "1 KiB below it, so a restore always fits",
    )  # fmt: skip
    max_snapshot_bytes: int = setting(
        8 * 1024 * 1024, minimum=1024, shown_default="`8388608` (8 MiB)",
        help="largest snapshot the server makes or restores",
        details="envelope and signature included; a bigger one is refused in-band, the "
        "limit in the message (`RESOURCE_EXHAUSTED` for an env's snapshot, "
        "`INVALID_ARGUMENT` for a restore), and the session goes on. Kept 1 KiB below "
        "`--max-message-bytes` whatever is set, so a snapshot always fits a message; Info "
        "reports the limit in force",
    )  # fmt: skip
    max_held_bytes: int = setting(
        128 * 1024 * 1024, minimum=1024 * 1024, shown_default="`134217728` (128 MiB)",
        help="request and answer bytes the server process holds for all its clients at "
        "once (answers waiting for slow readers, isolated frames, states and snapshots "
        "being gathered)",
        details="one budget across every stream (`openenv_grpc/server/process/budget.py`); a "
        "holder that finds it short stops reading or answers in-band "
        "`RESOURCE_EXHAUSTED` with pushback. One message up to `--max-message-bytes` "
        "always fits when nothing else is held. Sized for a 2-core, 24 GiB machine; "
        "what a request still arriving holds is bounded separately (docs/reliability.md)",
    )  # fmt: skip
    outsider_held_bytes: int = setting(
        32 * 1024 * 1024, minimum=64 * 1024, shown_default="`33554432` (32 MiB)",
        help="request bytes that callers without a valid token (health probes; everyone "
        "when `AUTH_TOKEN` is unset) may make the server buffer at once",
        details="each read of such a unary request (health, Info) reserves the request "
        "limit first, as gRPC grants a read the window its length prefix announces; "
        "past the budget a newcomer pushes out the oldest read still arriving after "
        "5 ms (waiting that long for one), or is refused `RESOURCE_EXHAUSTED` with "
        "pushback before a byte is read; "
        "such a request must arrive within 1 s (`openenv_grpc/server/process/outsiders.py`). "
        "Token-bearing calls never draw from it",
    )  # fmt: skip
    env_threads: int = setting(
        factory=_default_threads, minimum=1, shown_default="cores + 4 (≤ 32)",
        help="shared pool for blocking sync envs' reset/step/state",
        details="as many threads again build those envs and as many again close them, so "
        "a fresh env never waits behind blocked calls or hung closes (daemon threads, "
        "started on demand)",
    )  # fmt: skip
    lifecycle_timeout: float = setting(
        60.0, minimum=0,
        help="seconds a pooled env's factory or close(), or an async env's close(), may "
        "take; `0` = no limit",
        details="creates and closes run on pools of their own (`--env-threads` each), so a "
        "hung close never delays an open. A factory past it fails that open with "
        "`DEADLINE_EXCEEDED` (its env, if ever born, is closed then). A close past it is "
        "abandoned (logged, its daemon thread no longer counted against the pool): the "
        "env still exists, so it keeps its slot of the capacity until its close returns; "
        "an async env's close is cancelled instead. A close command so given up on is "
        "answered `DEADLINE_EXCEEDED`",
    )  # fmt: skip
    inline_threshold_ms: float = setting(
        1.0, minimum=0,
        help="milliseconds: a sync env that leaves `runs_inline` unset has its calls run on "
        "the event loop while they take less than this, on the thread pool otherwise; `0` = "
        "always the pool",
        details="measured per method and per `cost_class()` (the gymnasium env's env id): "
        "32 calls in a row under half of it move a group to the loop, a second call over it "
        "within 64 (or one over 50 times it) moves it back, logged as a WARNING with how long the "
        "loop was blocked; each move back doubles the next probation (a stall multiplies it "
        "by 50). With a step timeout "
        "such calls stay on the pool. Envs with `runs_inline = True`/`False` are not "
        "measured",
    )  # fmt: skip
    retry_pushback_ms: int = setting(
        500, minimum=0, help="retry hint sent with `RESOURCE_EXHAUSTED`",
    )  # fmt: skip
    workers: int = setting(
        1, minimum=1,
        help="server processes sharing the port (SO_REUSEPORT, forked before any gRPC "
        "object)",
        details="the kernel balances *connections*, so clients use "
        "`AioChannelPool(target, size)` to spread sessions; `MAX_CONCURRENT_ENVS` is per "
        "server and split evenly (Info reports the answering worker's share, its pid and "
        "the worker count); a worker that dies is restarted",
    )  # fmt: skip
    isolated: int = setting(
        0, minimum=0, help="run env instances in this many worker processes (spawned); `0` = off",
        details="a crash, `os._exit` or segfault in env code ends only that worker's "
        "sessions (`UNAVAILABLE` \"session lost\") and the worker is replaced; CPU-heavy "
        "envs use every core even over one connection. Env calls in a worker run one at a "
        "time, but the front never waits on a worker: a busy one delays only its own "
        "sessions, never health, Info or other workers. Step timeouts interrupt: a worker "
        "that has not answered a call (reset/step/state/close) within the step timeout is "
        "killed and replaced; the waiting session gets `DEADLINE_EXCEEDED` and a fresh env "
        "on a live worker, the worker's other sessions end with `UNAVAILABLE` \"session "
        "lost\" (async envs are cancelled inside the worker first). On drain, a worker "
        "still busy with one call 2 s after the grace ends is killed, so a hung call cannot "
        "hold the process. After a worker dies, the env's `reclaim_orphans()` runs",
    )  # fmt: skip
    max_env_bytes: int = setting(
        1024 * 1024 * 1024, minimum=0, shown_default="`1073741824` (1 GiB)",
        help="with `--isolated`: most memory building one env instance may add to its env "
        "process; `0` = no ceiling",
        details="measured in the env process, its resident memory (`/proc/self/statm`) "
        "right before and after each env's factory (a native batch: its growth per env). "
        "An env past it is closed, with every env of its stream made so far, and the open "
        "is refused `INVALID_ARGUMENT` naming the env and the ceiling (not "
        "`RESOURCE_EXHAUSTED`: asking again cannot succeed); nothing is kept. Sized for a "
        "24 GiB machine (1/24 of it per env); in-process envs are not measured",
    )  # fmt: skip
    reuse_port: int = setting(
        0, choices=(0, 1),
        help="`1` lets separate server processes bind the same port (SO_REUSEPORT)",
        details="e.g. swarm replicas on one host network; the kernel balances connections "
        "among them. With `0` binding a taken port fails loudly",
    )  # fmt: skip
    keepalive_time: float = setting(
        30.0, above=0, help="seconds between pings that detect dead clients",
    )  # fmt: skip
    keepalive_timeout: float = setting(10.0, above=0, help="seconds to wait for a ping's answer")
    handshake_timeout: float = setting(
        3.0, above=0,
        help="seconds a new connection to the gRPC port has to complete its handshake (TLS, "
        "then the HTTP/2 preface and SETTINGS) before the server closes it",
        details="a client sends these as soon as it connects; a connection that says "
        "nothing, or only the preface, held a file descriptor for 40 s before "
        "(docs/reliability.md, round three)",
    )  # fmt: skip
    max_connections: int = setting(
        0, minimum=0, maximum=_INT32_MAX,
        shown_default="`0` (the open-file limit, raised to its hard limit at start, less "
        "an eighth of it and at least 256)",
        help="connections the gRPC port accepts at once; past it a new one is closed at once",
        details="keeps file descriptors in reserve for env processes, files and the "
        "metrics port: without it, 20,400 silent connections took every descriptor and "
        "new clients timed out",
    )  # fmt: skip
    step_timeout: float = setting(
        0.0, minimum=0, shown_default="`0` (the env's own `step_timeout`, none by default)",
        help="seconds an env's reset/step/state may take, counted from when the call starts "
        "(not while it waits for a pool thread)",
        details="past it the client gets `DEADLINE_EXCEEDED` and the session a fresh env "
        "(reset to go on); the hung instance is closed when its call returns and holds its "
        "slot until then (so at the cap no fresh env can be made: `RESOURCE_EXHAUSTED` and "
        "the session ends). A call still waiting for a thread when the timeout passes never "
        "runs: `RESOURCE_EXHAUSTED` \"env thread pool saturated: N of N threads busy; the "
        "episode is unchanged, retry\" (metric `openenv_env_pool_saturated_total`). Inline "
        "envs run on the event loop and cannot be interrupted, except with `--isolated`, "
        "where the front kills the worker (see above)",
    )  # fmt: skip
    tls_cert: str = setting(
        "", help="PEM certificate chain file; with `--tls-key`, the server speaks TLS",
    )  # fmt: skip
    tls_key: str = setting("", help="PEM private key file for `--tls-cert`")
    tls_client_ca: str = setting(
        "", help="PEM CA file: clients must present a certificate it signed (mutual TLS)",
    )  # fmt: skip
    auth_token: str = setting(
        "", secret=True,
        help="every call but health checks needs `authorization: Bearer <token>`; others "
        "get `UNAUTHENTICATED` before any env exists",
        details="compared in constant time; no option on purpose: a command line is "
        "visible to other users",
    )  # fmt: skip
    snapshot_keys: str = setting(
        "", secret=True, shown_default="unset (a random key per server)",
        help="keys that sign and verify snapshots: comma-separated `id:secret` pairs; the "
        "first signs, all verify (rotate by putting the new key first)",
        details="HMAC-SHA256, compared in constant time; ids are 1-64 of `A-Z a-z 0-9 . _ "
        "-`, secrets at least 16 bytes (e.g. `openssl rand -hex 32`). Servers sharing a "
        "key restore each other's snapshots (of the same env name and version). Unset "
        "(and no file): a random key made at start, shared by the server's `--workers` "
        "and `--isolated` processes, so its snapshots restore on this server only, until "
        "it exits. Read once at start and removed from the environment env code inherits; "
        "no option on purpose: a command line is visible to other users",
    )  # fmt: skip
    snapshot_keys_file: str = setting(
        "",
        help="file holding the snapshot keys instead (same `id:secret` pairs, separated by "
        "commas or newlines; `#` starts a comment line)",
        details="read once at start; a file others may read is logged as a warning; set "
        "this or `SNAPSHOT_KEYS`, not both",
    )  # fmt: skip
    log_level: str = setting(
        "INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
        help="what the server logs (to stderr), in any case",
    )  # fmt: skip
    log_format: str = setting(
        "text", choices=("text", "json"), help="log lines as text, or one JSON object per line",
        details="every line about a session carries its id, which the client sees as "
        "`env.session_id`",
    )  # fmt: skip
    metrics_port: int = setting(
        -1, minimum=-1, maximum=65535,
        help="Prometheus `/metrics` port (on `METRICS_HOST`); `-1` off, `0` a free port",
        details="with workers, worker i serves on `metrics_port + i`",
    )  # fmt: skip
    metrics_host: str = setting(
        "127.0.0.1",
        help="address of the metrics endpoint: loopback unless told otherwise (`0.0.0.0` "
        "for a Prometheus outside the pod), whatever `HOST` is",
        details="the endpoint runs on the server's event loop: 64 connections served at once "
        "(more wait in the listen queue, a slow one gives way after 0.5 s), 5 s "
        "to send a request head and 5 s to take the answer, `GET /metrics` only",
    )  # fmt: skip
    metrics_token: str = setting(
        "", secret=True,
        help="when set, a scrape needs `authorization: Bearer <token>`; when unset, "
        "`AUTH_TOKEN` (if set) guards the endpoint",
    )  # fmt: skip
    max_streams_per_connection: int = setting(
        0, minimum=0, maximum=_INT32_MAX,
        shown_default="`0` (the pending-call limit, at least capacity + 32; no limit when "
        "capacity is unlimited)",
        help="HTTP/2 streams (sessions and other calls) one client connection may have open",
        details="grpc counts a stream against it until the server has let its call go, "
        "and resets streams past it with REFUSED_STREAM (UNAVAILABLE to most clients) "
        "instead of our RESOURCE_EXHAUSTED: below the largest burst of opens one "
        "connection sends, a burst past the capacity gets some. It also bounds what one "
        "connection's reset streams hold (rapid reset); `MAX_PENDING_CALLS` bounds all "
        "connections together",
    )  # fmt: skip
    max_pending_calls: int = setting(
        0, minimum=0, maximum=_INT32_MAX,
        shown_default="`0` (4 x capacity + 512 within `4608`..`32768`: `4608` at the "
        "default capacity; `32768` when capacity is unlimited)",
        help="calls gRPC holds for the server before its handlers pick them up",
        details="beyond it gRPC itself refuses calls (not the limiter); it must cover the "
        "largest burst of session opens expected at once (4,000 on one connection, "
        "2,976 over four at capacity 100 and 16,384 at 4,096 are tested) and bounds what "
        "a rapid-reset flood costs, whatever its connections (~17 KiB a held call: "
        "~77 MiB at the default)",
    )  # fmt: skip

    def __post_init__(self) -> None:
        for name, _, meta, _ in settings():
            _check(meta, name, getattr(self, name))

    @property
    def capacity(self) -> int:
        """The session cap, with 0 meaning unlimited."""
        return max(self.max_concurrent_envs, 0)

    @property
    def pending_calls(self) -> int:
        """The calls gRPC may hold for the handlers (docs/reliability.md, round three)."""
        if self.max_pending_calls:
            return self.max_pending_calls
        # A burst of opens four times the capacity, or issue 19's 4,000, reaches the
        # limiter; a held call costs ~17 KiB in a rapid-reset flood, hence the ceiling.
        most = 32768
        return min(max(4 * self.capacity + 512, 4608), most) if self.capacity else most

    @property
    def streams_per_connection(self) -> int:
        """The HTTP/2 stream limit per connection (0: none): by default the pending-call
        limit, so every open a connection sends reaches the limiter (never REFUSED_STREAM)."""
        if self.max_streams_per_connection:
            return self.max_streams_per_connection
        return max(self.capacity + STREAM_HEADROOM, self.pending_calls) if self.capacity else 0

    @property
    def address(self) -> str:
        """``host:port`` as gRPC wants it (IPv6 hosts bracketed)."""
        host = self.host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{host}:{self.port}"

    @property
    def request_limit(self) -> int:
        """``max_request_bytes``, else 4 MiB raised to fit a restore of the largest
        snapshot; never above the message limit."""
        wanted = self.max_request_bytes or max(
            DEFAULT_REQUEST_BYTES, self.max_snapshot_bytes + SNAPSHOT_MARGIN
        )
        return min(wanted, self.max_message_bytes)

    @property
    def snapshot_limit(self) -> int:
        """``max_snapshot_bytes``, kept 1 KiB below the request limit so a snapshot always
        fits a request or a response."""
        return max(1, min(self.max_snapshot_bytes, self.request_limit - SNAPSHOT_MARGIN))

    def call_timeout(self, env_default: float | None) -> float | None:
        """Longest an env call may take: ``step_timeout``, else the env class's own
        (``env_default``); None: no limit."""
        return self.step_timeout or env_default or None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> ServerConfig:
        """A config from ``environ`` (default: ``os.environ``), then ``overrides`` (None
        values ignored); ValueError if a value does not parse or is out of range."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, kind, meta, _ in settings():
            if raw := environ.get(meta.variable, "").strip():
                try:
                    values[name] = kind(raw)
                except ValueError:
                    raise ValueError(
                        f"{meta.variable}={raw!r} is not a valid {kind.__name__}"
                    ) from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def settings() -> list[tuple[str, type, Setting, Any]]:
    """Every setting: (field name, type, its :class:`Setting`, its default value)."""
    result = []
    for spec in fields(ServerConfig):
        meta: Setting = spec.metadata["setting"]
        flag = None if meta.secret else meta.flag or "--" + spec.name.replace("_", "-")
        meta = replace(meta, variable=meta.variable or spec.name.upper(), flag=flag)
        default = spec.default_factory() if callable(spec.default_factory) else spec.default
        result.append((spec.name, _KINDS[str(spec.type)], meta, default))
    return result


#: Field name -> the environment variable that sets it.
ENV_VARS: dict[str, str] = {name: meta.variable for name, _, meta, _ in settings()}


def settings_table() -> str:
    """The settings table of docs/settings.md, in Markdown (one row per setting)."""
    lines = ["| flag | variable | default | meaning |", "|---|---|---|---|"]
    for _, _, meta, default in settings():
        flag = f"`{meta.flag}`" if meta.flag else "—"
        value = _number(default) if isinstance(default, float) else default
        shown = meta.shown_default or (f"`{value}`" if default != "" else "unset")
        meaning = meta.help + (f"; {meta.details}" if meta.details else "")
        if bounds := _bounds(meta):
            meaning += f" ({bounds})"
        lines.append(f"| {flag} | `{meta.variable}` | {shown} | {meaning} |")
    return "\n".join(lines) + "\n"


def _bounds(meta: Setting) -> str:
    if meta.choices:
        return "one of " + ", ".join(f"`{c}`" for c in meta.choices)
    if meta.minimum is not None and meta.maximum is not None:
        return f"`{_number(meta.minimum)}`..`{_number(meta.maximum)}`"
    if meta.minimum is not None:
        return f"≥ `{_number(meta.minimum)}`"
    if meta.above is not None:
        return f"> `{_number(meta.above)}`"
    return ""


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _check(meta: Setting, name: str, value: Any) -> None:
    if meta.choices and str(value).lower() not in {str(c).lower() for c in meta.choices}:
        allowed = " or ".join(str(c) for c in meta.choices)
        raise ValueError(f"{name} must be {allowed}, got {value}")
    if meta.above is not None and value <= meta.above:
        raise ValueError(f"{name} must be > {_number(meta.above)}, got {value}")
    if meta.minimum is not None and value < meta.minimum:
        raise ValueError(f"{name} must be >= {_number(meta.minimum)}, got {value}")
    if meta.maximum is not None and value > meta.maximum:
        raise ValueError(f"{name} must be <= {_number(meta.maximum)}, got {value}")
