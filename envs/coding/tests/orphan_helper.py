"""Opens a sandbox, starts hostile code in it, and blocks until it is killed.

Run by ``test_reliability_sandbox.py`` as a process of its own, which the test then
SIGKILLs: an owner that dies without closing its sandbox, as a server does when a drain
overruns its grace or an isolated worker crashes. Prints one JSON line (the sandbox's
uid, directory tree and cgroups) before the code starts; the code itself writes what it
made to ``facts.json`` in its working directory.
"""

from __future__ import annotations

import json
import sys

from openenv_grpc_envs.coding.limits import Limits
from openenv_grpc_envs.coding.sandbox import Sandbox

#: Leaves everything it can behind: a SysV segment, files in /dev/shm, /run/lock and
#: /tmp, and a child in a session of its own, sleeping.
HOSTILE = """\
import ctypes, json, os, time
libc = ctypes.CDLL(None, use_errno=True)
shmid = libc.shmget(0, 64 << 20, 0o1000 | 0o600)  # IPC_PRIVATE, IPC_CREAT
for folder in ("/dev/shm", "/run/lock", "/tmp"):
    with open(f"{folder}/orphan-{os.getuid()}", "w") as marker:
        marker.write("left behind")
child = os.fork()
if child == 0:
    os.setsid()
    time.sleep(600)
    os._exit(0)
facts = {"shmid": shmid, "child": child, "ipc_ns": os.readlink("/proc/self/ns/ipc")}
with open("facts.tmp", "w") as out:
    json.dump(facts, out)
os.rename("facts.tmp", "facts.json")
time.sleep(600)
"""


def main() -> None:
    limits = Limits(
        cpu_seconds=30, wall_ms=600_000, memory_mb=256, output_bytes=4096, processes=16,
        file_size_mb=1,
    )  # fmt: skip
    sandbox = Sandbox(limits, allow_network=False)
    print(
        json.dumps(
            {
                "uid": sandbox.uid,
                "base": str(sandbox.base),
                "workdir": str(sandbox.workdir),
                "cgroups": [str(p) for p in sandbox.cgroup.paths] if sandbox.cgroup else [],
            }
        ),
        flush=True,
    )
    sandbox.prepare(HOSTILE, (), {})
    result = sandbox.run(b"")  # the code sleeps: the test kills this process meanwhile
    sys.exit(f"the hostile code ended before this process was killed: {result}")


if __name__ == "__main__":
    main()
