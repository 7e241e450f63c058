"""The limits of a sandbox: defaults, the server's maxima, and what a client may ask for.

The operator decides the maxima (:class:`CodingSettings`, from ``CODING_*`` environment
variables or given to :class:`~openenv_grpc_envs.coding.CodingEnvironment`); a client's
reset options choose limits up to them (:func:`resolve_limits`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

from openenv_grpc import InvalidAction
from openenv_grpc_envs.coding.v1.coding_pb2 import CodingLimits

__all__ = [
    "DEFAULTS",
    "ENV_VARS",
    "MIN_MEMORY_MB",
    "MIN_PROCESSES",
    "CodingSettings",
    "Limits",
    "resolve_limits",
]


@dataclass(frozen=True, slots=True)
class Limits:
    """Resource limits of every run of a sandbox (all values filled in)."""

    cpu_seconds: int
    wall_ms: int
    memory_mb: int
    output_bytes: int
    processes: int
    file_size_mb: int


#: Limits used for every field a client leaves at 0 (lowered to the server's maxima).
DEFAULTS = Limits(
    cpu_seconds=5,
    wall_ms=10_000,
    memory_mb=512,
    output_bytes=64 * 1024,
    processes=32,
    file_size_mb=16,
)
#: Smallest memory limit: the interpreter alone needs a few tens of MiB.
MIN_MEMORY_MB = 64
#: Smallest process cap: the interpreter itself is one task.
MIN_PROCESSES = 2
#: Largest value any maximum may take (the wire's fields are uint32).
CEILING = 2**31 - 1

#: CodingSettings field -> the environment variable that sets it.
ENV_VARS = {
    "max_cpu_seconds": "CODING_MAX_CPU_SECONDS",
    "max_wall_ms": "CODING_MAX_WALL_MS",
    "max_memory_mb": "CODING_MAX_MEMORY_MB",
    "max_sandbox_memory_mb": "CODING_MAX_SANDBOX_MEMORY_MB",
    "max_output_bytes": "CODING_MAX_OUTPUT_BYTES",
    "max_processes": "CODING_MAX_PROCESSES",
    "max_file_size_mb": "CODING_MAX_FILE_SIZE_MB",
    "allow_network": "CODING_ALLOW_NETWORK",
}
#: Smallest value of each maximum.
FLOORS = {
    "max_cpu_seconds": 1,
    "max_wall_ms": 1,
    "max_memory_mb": MIN_MEMORY_MB,
    "max_sandbox_memory_mb": MIN_MEMORY_MB * MIN_PROCESSES,
    "max_output_bytes": 1,
    "max_processes": MIN_PROCESSES,
    "max_file_size_mb": 1,
}


@dataclass(frozen=True, slots=True)
class CodingSettings:
    """What the operator allows a client to ask of a sandbox.

    Attributes:
        max_cpu_seconds: Most CPU seconds per process a client may ask for.
        max_wall_ms: Most wall-clock milliseconds per run.
        max_memory_mb: Most ``memory_mb``: the whole sandbox's memory where the host has
            a memory cgroup for it, else one process's address space.
        max_sandbox_memory_mb: Most memory one sandbox may hold in the worst case: with a
            memory cgroup that is ``memory_mb``; without one, ``memory_mb x processes``
            (each process may fill its own address-space limit).
        max_output_bytes: Most bytes of stdout (and of stderr) kept per run.
        max_processes: Most processes + threads at once.
        max_file_size_mb: Largest file a process may write.
        allow_network: Whether a client may set ``allow_network``; then its code shares
            the server's network namespace (loopback and the server's own port included).

    Raises:
        ValueError: a maximum is below its floor or above 2**31 - 1.
    """

    max_cpu_seconds: int = 60
    max_wall_ms: int = 120_000
    max_memory_mb: int = 4096
    max_sandbox_memory_mb: int = 16384
    max_output_bytes: int = 4 * 1024 * 1024
    max_processes: int = 256
    max_file_size_mb: int = 1024
    allow_network: bool = False

    def __post_init__(self) -> None:
        for name, floor in FLOORS.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an int, got {value!r}")
            if not floor <= value <= CEILING:
                raise ValueError(f"{name} must be in {floor}..{CEILING}, got {value}")
        if not isinstance(self.allow_network, bool):
            raise ValueError(f"allow_network must be a bool, got {self.allow_network!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> CodingSettings:
        """Read the ``CODING_*`` variables of ``environ`` (default: ``os.environ``); unset
        or empty ones keep their defaults.

        Raises:
            ValueError: a variable is not a plain decimal number (``CODING_ALLOW_NETWORK``:
                not ``0`` or ``1``) or is out of range; the message names it.
        """
        environ = os.environ if environ is None else environ
        values: dict[str, int | bool] = {}
        for name, var in ENV_VARS.items():
            raw = environ.get(var, "").strip()
            if not raw:
                continue
            if name == "allow_network":
                if raw not in ("0", "1"):
                    raise ValueError(f"{var}={raw!r} must be 0 or 1")
                values[name] = raw == "1"
                continue
            if not (raw.isascii() and raw.isdecimal()):
                raise ValueError(f"{var}={raw!r} is not a whole number")
            floor = FLOORS[name]
            if not floor <= int(raw) <= CEILING:
                raise ValueError(f"{var}={raw} must be in {floor}..{CEILING}")
            values[name] = int(raw)
        return cls(**values)  # type: ignore[arg-type]

    @property
    def maxima(self) -> Limits:
        """The per-field maxima as limits."""
        return Limits(
            cpu_seconds=self.max_cpu_seconds,
            wall_ms=self.max_wall_ms,
            memory_mb=self.max_memory_mb,
            output_bytes=self.max_output_bytes,
            processes=self.max_processes,
            file_size_mb=self.max_file_size_mb,
        )


def resolve_limits(
    requested: CodingLimits | None, settings: CodingSettings, *, memory_cgroup: bool
) -> Limits:
    """Fill in the defaults and enforce the server's maxima.

    Args:
        requested: The client's limits (0 in a field: its default), or None.
        settings: The server's maxima.
        memory_cgroup: The host gives each sandbox one memory budget (a cgroup); without
            it, ``memory_mb x processes`` is what a sandbox may hold, and defaults shrink
            to keep that within ``max_sandbox_memory_mb``.

    Raises:
        InvalidAction: a field exceeds the server's maximum or is below its floor, or the
            sandbox's worst-case memory exceeds ``max_sandbox_memory_mb``; the message
            names the maximum and the variable that sets it.
    """
    maxima = settings.maxima
    asked = {f.name: getattr(requested, f.name) if requested else 0 for f in fields(Limits)}
    values = {}
    for name, value in asked.items():
        maximum = getattr(maxima, name)
        if value > maximum:
            raise InvalidAction(
                f"limits.{name} is {value}; the server's maximum is {maximum} "
                f"({ENV_VARS['max_' + name]})"
            )
        values[name] = value or min(getattr(DEFAULTS, name), maximum)
    if values["memory_mb"] < MIN_MEMORY_MB:
        raise InvalidAction(
            f"limits.memory_mb is {values['memory_mb']}; the minimum is {MIN_MEMORY_MB}"
        )
    if values["processes"] < MIN_PROCESSES:
        raise InvalidAction(
            f"limits.processes is {values['processes']}; the minimum is {MIN_PROCESSES}"
        )
    budget = settings.max_sandbox_memory_mb
    var = ENV_VARS["max_sandbox_memory_mb"]
    if memory_cgroup:
        if not asked["memory_mb"]:
            values["memory_mb"] = min(values["memory_mb"], budget)
        if values["memory_mb"] > budget:
            raise InvalidAction(
                f"limits.memory_mb is {values['memory_mb']}; the server's maximum for one "
                f"sandbox is {budget} MiB ({var})"
            )
        return Limits(**values)
    # No sandbox-wide budget: each process may fill its own address space.
    if not asked["processes"]:
        values["processes"] = max(
            MIN_PROCESSES, min(values["processes"], budget // values["memory_mb"])
        )
    if not asked["memory_mb"]:
        fit = max(MIN_MEMORY_MB, budget // values["processes"])
        values["memory_mb"] = min(values["memory_mb"], fit)
    worst = values["memory_mb"] * values["processes"]
    if worst > budget:
        raise InvalidAction(
            f"limits.memory_mb x limits.processes is {worst} MiB; this host bounds memory "
            f"per process only, and the server's maximum for one sandbox is {budget} MiB "
            f"({var})"
        )
    return Limits(**values)
