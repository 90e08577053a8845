"""MkDocs hook: pages added under docs/ join the nav without editing mkdocs.yml.

- every ``docs/invariants/*.md`` goes in the "Invariants" section: ``index.md`` first, then the built-in
  invariants in ``registry.BUILTIN`` order, then any other page by name;
- every ``docs/guides/*.md`` the nav does not list goes at the end of "Guides";
- any other page the nav does not list goes at the top level, before "Reference".

A page's title is its first heading, as MkDocs reads it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _builtin() -> tuple[str, ...]:
    sys.path.insert(0, str(ROOT))
    try:
        from pytest_torchperf.registry import BUILTIN
    except Exception:  # noqa: BLE001 - without the package, pages go in order of name
        return ()
    finally:
        sys.path.remove(str(ROOT))
    return tuple(BUILTIN)


def _listed(nav: Any) -> set[str]:
    out: set[str] = set()
    if isinstance(nav, str):
        out.add(nav)
    elif isinstance(nav, list):
        for item in nav:
            out |= _listed(item)
    elif isinstance(nav, dict):
        for value in nav.values():
            out |= _listed(value)
    return out


def _section(nav: list[Any], title: str) -> Any:
    for item in nav:
        if isinstance(item, dict) and title in item:
            return item
    return None


def invariant_pages(docs: Path) -> list[str]:
    found = {p.stem for p in (docs / "invariants").glob("*.md")}
    order = [name for name in _builtin() if name in found]
    order += sorted(found - set(order) - {"index"})
    return (["invariants/index.md"] if "index" in found else []) + [f"invariants/{name}.md" for name in order]


def on_config(config: Any, **kwargs: Any) -> Any:
    docs = Path(config["docs_dir"])
    nav = config["nav"]
    if not isinstance(nav, list):
        return config
    invariants = _section(nav, "Invariants")
    if invariants is not None:
        invariants["Invariants"] = invariant_pages(docs)
    listed = _listed(nav)
    guides = _section(nav, "Guides")
    if guides is not None:
        guides["Guides"] = list(guides["Guides"]) + [
            f"guides/{p.name}" for p in sorted((docs / "guides").glob("*.md")) if f"guides/{p.name}" not in listed
        ]
    listed = _listed(nav)
    extra = [
        p.relative_to(docs).as_posix()
        for p in sorted(docs.rglob("*.md"))
        if p.relative_to(docs).as_posix() not in listed and not p.relative_to(docs).as_posix().startswith("invariants/")
    ]
    reference = _section(nav, "Reference")
    at = nav.index(reference) if reference is not None else len(nav)
    nav[at:at] = extra
    return config
