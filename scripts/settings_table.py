"""Write the server settings table (docs/settings.md) from openenv_grpc/server/config.py, where each
setting is defined once (``--check``: fail if the page differs, write nothing)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from openenv_grpc.server.config import settings_table

README = Path(__file__).resolve().parent.parent / "docs" / "settings.md"
START = "<!-- settings table: made by scripts/settings_table.py from server/config.py -->"
END = "<!-- end of settings table -->"


def render(readme: str) -> str:
    """``readme`` with the block between the markers replaced by the current table."""
    head, found, rest = readme.partition(START)
    _, ended, tail = rest.partition(END)
    if not (found and ended):
        raise SystemExit(f"{README}: the settings table markers are missing")
    return f"{head}{START}\n{settings_table()}{END}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="only compare")
    args = parser.parse_args()
    current = README.read_text(encoding="utf-8")
    wanted = render(current)
    if args.check:
        if current != wanted:
            print("docs/settings.md's settings table is out of date: run make settings-table")
            return 1
        return 0
    README.write_text(wanted, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
