"""Rewrite the README's argument tables from the invariant registry (``--check``: only compare).

The tables sit between ``<!-- arguments:start -->`` and ``<!-- arguments:end -->``;
``tests/test_registry.py`` fails when they differ from what this prints.

    python scripts/readme_tables.py          # rewrite README.md
    python scripts/readme_tables.py --check  # exit 1 when README.md is out of date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pytest_torchperf import registry

README = Path(__file__).resolve().parent.parent / "README.md"
START, END = "<!-- arguments:start -->", "<!-- arguments:end -->"


def rendered(text: str) -> str:
    """``text`` with the tables between the markers replaced by the registry's."""
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{registry.markdown_table()}\n{END}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 when out of date")
    args = parser.parse_args()
    text = README.read_text(encoding="utf-8")
    new = rendered(text)
    if args.check:
        if new != text:
            print("README.md's argument tables differ from the registry: run python scripts/readme_tables.py")
            return 1
        return 0
    README.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
