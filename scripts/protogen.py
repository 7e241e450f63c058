"""Generate Python code from proto/ (`make proto`), or check that it has not drifted.

Proto packages map to source folders: `openenv_grpc.*` lands in `openenv_grpc/`, and
`openenv_grpc_envs.*` in `envs/` (the catalogue imports as `openenv_grpc_envs`).
Usage: protogen.py [--check]
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
# First path component of a proto file -> the source folder its code goes to.
DESTINATIONS = {"openenv_grpc": ROOT / "openenv_grpc", "openenv_grpc_envs": ROOT / "envs"}
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def generate(out: Path) -> None:
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    bindir = Path(sys.executable).parent
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--plugin=protoc-gen-mypy={bindir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bindir / 'protoc-gen-mypy_grpc'}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        *protos,
    ]
    subprocess.run(cmd, check=True, cwd=PROTO_ROOT)


def generated_files(root: Path) -> dict[Path, Path]:
    """Map each generated file below `root` (a protoc out dir) to its place in the tree."""
    mapping: dict[Path, Path] = {}
    for path in root.rglob("*"):
        if path.is_file() and path.name.endswith(GENERATED_SUFFIXES):
            rel = path.relative_to(root)
            mapping[path] = DESTINATIONS[rel.parts[0]].joinpath(*rel.parts[1:])
    return mapping


def tracked_generated() -> set[Path]:
    found: set[Path] = set()
    for dest in DESTINATIONS.values():
        found.update(
            p for p in dest.rglob("*") if p.is_file() and p.name.endswith(GENERATED_SUFFIXES)
        )
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the tree has drifted")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        mapping = generated_files(Path(tmp))
        expected = set(mapping.values())
        stale = tracked_generated() - expected
        changed = [
            dst
            for src, dst in mapping.items()
            if not dst.exists() or not filecmp.cmp(src, dst, shallow=False)
        ]
        if args.check:
            for path in sorted(changed):
                print(f"drift: {path.relative_to(ROOT)} differs from `make proto` output")
            for path in sorted(stale):
                print(f"drift: {path.relative_to(ROOT)} has no .proto source")
            if changed or stale:
                print("generated code is out of date: run `make proto` and commit the result")
                return 1
            print(f"generated code matches proto/ ({len(mapping)} files)")
            return 0
        for src, dst in mapping.items():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
            # Generated folders are packages; an empty __init__.py makes them importable.
            (dst.parent / "__init__.py").touch()
        for path in stale:
            path.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
