"""Print the requirements of openenv-grpc plus some extras, one a line, from pyproject.toml,
and its build requirements (so the project itself installs without build isolation).

Used by the Dockerfile to install dependencies in their own (cached) layer:
``python3 requirements.py pyproject.toml gymnasium,atari``. Exits non-zero on an unknown extra.
"""

import sys

import tomllib


def main() -> None:
    with open(sys.argv[1], "rb") as f:
        pyproject = tomllib.load(f)
    project = pyproject["project"]
    extras: dict[str, list[str]] = project.get("optional-dependencies", {})
    wanted = [e.strip() for e in (sys.argv[2] if len(sys.argv) > 2 else "").split(",")]
    wanted = [e for e in wanted if e]
    unknown = [e for e in wanted if e not in extras]
    if unknown:
        sys.exit(f"unknown extras {unknown}; pyproject.toml has {sorted(extras)}")
    name = project["name"]
    seen: set[str] = set()

    def emit(requirements: list[str]) -> None:
        for requirement in requirements:
            base, _, rest = requirement.partition("[")
            # "openenv-grpc[a,b]" names other extras of this project: spell them out.
            if base.strip() == name:
                for extra in rest.split("]")[0].split(","):
                    if extra.strip() not in seen:
                        seen.add(extra.strip())
                        emit(extras[extra.strip()])
            else:
                print(requirement)

    emit(pyproject.get("build-system", {}).get("requires", []))
    emit(project["dependencies"])
    for extra in wanted:
        seen.add(extra)
        emit(extras[extra])


if __name__ == "__main__":
    main()
