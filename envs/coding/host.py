"""What this host lets the sandbox do: probed once per server process, by trying it.

Each sandbox feature (IPC, mount and network namespaces, the seccomp filter, a cgroup)
is tried with a real run of the harness under a leased uid. What fails is left out, with
one log line saying what the sandbox then does instead; ``state()`` and the README say
the same to clients.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from openenv_grpc_envs.coding.cgroups import CgroupParents, find_parents
from openenv_grpc_envs.coding.processes import become_subreaper, quiet
from openenv_grpc_envs.coding.uids import SYSTEM_PATH, Killer, UidLease, as_uid

__all__ = ["FEATURES", "RUN_ENV", "HostSupport", "probe_host"]

log = logging.getLogger(__name__)

#: The whole environment of a run (HOME and TMPDIR are added per sandbox).
RUN_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    # glibc reserves 64 MiB of address space per thread arena; keep threads under RLIMIT_AS.
    "MALLOC_ARENA_MAX": "2",
}
#: Feature -> what the sandbox does without it (logged once when the probe finds it missing).
FEATURES = {
    "ipc_namespace": "SysV IPC objects of the sandbox uid are removed after each run",
    "mount_namespace": (
        "/dev/shm and /run/lock are the host's, swept of the sandbox uid's files after "
        "each run (their size is the host's)"
    ),
    "network_namespace": (
        "code has the server's network: sessions are refused unless CODING_ALLOW_NETWORK=1"
    ),
    "seccomp": (
        "code may create user namespaces and mount file systems inside them, and make "
        "kernel keys (removed with the sandbox)"
    ),
    "cgroup": (
        "memory is bounded per process only (memory_mb x processes must fit "
        "CODING_MAX_SANDBOX_MEMORY_MB)"
    ),
}


@dataclass(frozen=True, slots=True)
class HostSupport:
    """What this host lets the sandbox do."""

    #: The server runs as root: each sandbox gets a uid of its own.
    own_uid: bool
    #: The interpreter that runs the code, and its version.
    python: str
    python_version: str
    #: Path of setpriv (probes and the killer drop to a uid with it), or None.
    setpriv: str | None = None
    #: Ends every process of a uid at once (kill(-1) under it); None: /proc scans.
    killer: Killer | None = None
    #: Orphaned sandbox processes end up as this server's children, which reaps them.
    reaps_orphans: bool = False
    #: Each run gets its own IPC namespace (SysV IPC and POSIX queues die with it).
    ipc_namespace: bool = False
    #: Each run gets its own mount namespace with private tmpfs on /dev/shm, /run/lock.
    mount_namespace: bool = False
    #: Runs can get an empty network namespace.
    network_namespace: bool = False
    #: The code runs under a seccomp filter refusing namespaces and mounts.
    seccomp: bool = False
    #: Where each sandbox gets a cgroup (one memory and task budget), or None.
    cgroup: CgroupParents | None = None
    #: Why each missing feature is missing.
    missing: dict[str, str] = field(default_factory=dict)

    def has(self, feature: str) -> bool:
        """Whether ``feature`` (a key of :data:`FEATURES`) is available."""
        value = getattr(self, feature)
        return value is not None and value is not False


#: Runs one sandbox with the given support and says why its set-up failed (None: it ran).
Trial = Callable[[HostSupport], "str | None"]


def _which(name: str) -> str | None:
    return shutil.which(name, path=os.pathsep.join((os.environ.get("PATH", ""), SYSTEM_PATH)))


def probe_host(trial: Trial) -> HostSupport:
    """Work out what this host supports (a few runs of the harness, ~100 ms).

    Raises:
        RuntimeError: no interpreter runs the code the same under the sandbox uid.
    """
    setpriv = _which("setpriv")
    reaps = become_subreaper()
    if os.geteuid() != 0:
        python, version = _pick_python(None, setpriv)
        base = HostSupport(False, python, version, setpriv, reaps_orphans=reaps)
        return _with_features(base, trial, ("seccomp",))
    with UidLease(None) as lease:
        python, version = _pick_python(lease.uid, setpriv)
        killer = _working_killer(setpriv, python, lease.uid)
    base = HostSupport(True, python, version, setpriv, killer, reaps)
    parents, why = find_parents()
    features = tuple(FEATURES)
    if parents is None:
        base = replace(base, missing={"cgroup": why})
        features = tuple(f for f in FEATURES if f != "cgroup")
    else:
        base = replace(base, cgroup=parents)
    return _with_features(base, trial, features)


def _with_features(base: HostSupport, trial: Trial, features: tuple[str, ...]) -> HostSupport:
    """``base`` plus every feature of ``features`` that works (alone and together)."""
    parents = base.cgroup

    def only(chosen: tuple[str, ...]) -> HostSupport:
        values: dict[str, object] = {f: f in chosen for f in FEATURES if f != "cgroup"}
        values["cgroup"] = parents if "cgroup" in chosen else None
        return replace(base, **values)  # type: ignore[arg-type]

    everything = only(features)
    if trial(everything) is None:
        return everything
    missing = dict(base.missing)
    working = []
    for feature in features:
        error = trial(only((feature,)))
        if error is None:
            working.append(feature)
        else:
            missing[feature] = error
    chosen = only(tuple(working))
    if working and (error := trial(chosen)) is not None:
        for feature in working:
            missing[feature] = f"fails together with the others: {error}"
        chosen = only(())
    return replace(chosen, missing=missing)


def log_support(support: HostSupport) -> None:
    """One line of what the sandbox has, and one per missing feature with its fallback."""
    present = [f for f in FEATURES if support.has(f) and f != "cgroup"]
    if support.cgroup is not None:
        present.append(f"cgroup v{support.cgroup.version} under {support.cgroup.memory}")
    log.info(
        "coding sandbox: python %s (%s), %s, features: %s",
        support.python_version, support.python,
        "own uid per sandbox" if support.own_uid else "the server's uid (not root)",
        ", ".join(present) or "none",
    )  # fmt: skip
    for feature, why in support.missing.items():
        log.warning(
            "coding sandbox: no %s (%s): %s", feature.replace("_", " "), why, FEATURES[feature]
        )


def _working_killer(setpriv: str | None, python: str, uid: int) -> Killer | None:
    """The fastest :class:`Killer` that ends a sleeping process of ``uid``, if any."""
    for kill in (_which("kill") if setpriv else None, None):
        killer = Killer(setpriv, kill, python)
        if _kills(killer, setpriv, python, uid):
            return killer
    log.warning("coding sandbox: kill(-1) under a sandbox uid failed; using /proc scans")
    return None


def _kills(killer: Killer, setpriv: str | None, python: str, uid: int) -> bool:
    victim = subprocess.Popen(
        as_uid(setpriv, uid, python, "import time\ntime.sleep(30)\n"),
        env=RUN_ENV, cwd="/",
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        time.sleep(0.05)  # let it drop to the uid
        quiet(killer.argv(uid), RUN_ENV)
        return victim.wait(5) == -signal.SIGKILL
    except subprocess.TimeoutExpired:
        return False
    finally:
        victim.kill()
        victim.wait()


def _pick_python(uid: int | None, setpriv: str | None) -> tuple[str, str]:
    """The first interpreter that works the same under the sandbox's uid as for the server.

    A virtualenv's or pyenv's python under /root may start under another uid yet fall back
    to a different standard library; comparing ``sys.prefix`` both ways rules that out.
    """
    # Imports after the uid drop prove the standard library is readable by the sandbox;
    # the harness needs ctypes to build the sandbox.
    probe = "import ctypes, json, socket, sys; print(sys.prefix, '%d.%d.%d' % sys.version_info[:3])"
    override = os.environ.get("OPENENV_CODING_PYTHON")
    candidates = (
        [override]
        if override
        else [
            sys.executable,
            os.path.realpath(sys.executable),
            getattr(sys, "_base_executable", ""),
            "/usr/bin/python3",
            "/usr/local/bin/python3",
            _which("python3") or "",
        ]
    )
    seen: set[str] = set()
    for exe in candidates:
        if not exe or exe in seen or not os.access(exe, os.X_OK):
            continue
        seen.add(exe)
        mine = quiet([exe, "-I", "-S", "-c", probe], RUN_ENV)
        if mine is None:
            continue
        if uid is None or quiet(as_uid(setpriv, uid, exe, probe), RUN_ENV) == mine:
            return exe, mine.split()[-1]
    raise RuntimeError(f"no python interpreter runs the same under uid {uid}: tried {seen}")
