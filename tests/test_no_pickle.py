"""No pickle or other arbitrary deserialisation on the wire: only protobuf is parsed.

A static check over the library and the catalogue: none of them imports a module that
turns bytes into arbitrary objects. (The isolated pool's process start hands the env
factory to the worker through multiprocessing once; that is between our own processes,
never bytes from a client, and frames after that are protobuf.)
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "jsonpickle"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_no_module_deserialises_arbitrary_objects() -> None:
    sources = [
        path
        for folder in ("openenv_grpc", "envs")
        for path in (ROOT / folder).rglob("*.py")
        if "/tests/" not in str(path) and not path.name.endswith(("_pb2.py", "_pb2_grpc.py"))
    ]
    assert len(sources) > 40
    offenders = {str(p.relative_to(ROOT)): _imports(p) & FORBIDDEN for p in sources}
    assert {p: bad for p, bad in offenders.items() if bad} == {}


#: Files allowed to exec, and why.
EXEC_ALLOWED = {
    # The coding env's job: it runs the submitted code, inside the sandboxed child
    # process (own uid, rlimits, no network), never in the server.
    "envs/coding/harness.py",
}


def test_no_eval_of_client_data() -> None:
    for folder in ("openenv_grpc", "envs"):
        for path in (ROOT / folder).rglob("*.py"):
            if "/tests/" in str(path) or path.name.endswith("_pb2.py"):
                continue
            if str(path.relative_to(ROOT)) in EXEC_ALLOWED:
                continue
            tree = ast.parse(path.read_text())
            calls = [
                node.func.id
                for node in ast.walk(tree)
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            ]
            assert not {"eval", "exec"} & set(calls), path
