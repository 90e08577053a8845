"""The project under test: which installed packages are the user's own code.

Under tox, nox or a CI job that tests the built wheel, the package under test
is imported from site-packages, where frames are classified as a library's
(:mod:`pytest_torchperf.stacks`). So the plugin names the user's packages to
the classifier: the import packages of the project at pytest's rootdir (its
``pyproject.toml`` ``[project] name``, or ``setup.cfg`` ``[metadata] name``,
mapped to import names through the installed distribution's metadata:
``top_level.txt`` or its list of files) and the packages the settings name
(``--torchperf-user-packages`` / ``torchperf_user_packages``).

Plain Python (no pytest, no torch): :func:`user_packages` returns
:class:`~pytest_torchperf.stacks.UserPackage` records; :func:`check_names`
validates names given by the user.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

from ..errors import UsageError, suggest

if TYPE_CHECKING:
    from ..stacks import UserPackage

__all__ = ["check_names", "import_packages", "project_name", "user_packages"]

_IMPORT_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_NAME_LINE = re.compile(r"""^\s*name\s*=\s*["']([^"']+)["']""")


def _toml_project_name(text: str) -> Optional[str]:
    """``[project] name`` of a pyproject.toml (tomllib where there is one, else a small line reader)."""
    try:
        import tomllib  # type: ignore[import-not-found,unused-ignore]  # Python 3.11+
    except ImportError:  # pragma: no cover - Python 3.9/3.10
        tomllib = None
    if tomllib is not None:
        try:
            project = tomllib.loads(text).get("project") or {}
        except (ValueError, TypeError):
            return None
        name = project.get("name")
        return name if isinstance(name, str) else None
    section = None  # pragma: no cover - the same without tomllib
    for line in text.splitlines():  # pragma: no cover
        stripped = line.strip()
        if stripped.startswith("["):
            section = stripped.strip("[]").strip()
            continue
        if section == "project":
            match = _NAME_LINE.match(line)
            if match:
                return match.group(1)
    return None  # pragma: no cover


def project_name(rootdir: str) -> Optional[tuple[str, str]]:
    """``(distribution name, file that names it)`` of the project at ``rootdir``, if it declares one."""
    pyproject = os.path.join(rootdir, "pyproject.toml")
    if os.path.isfile(pyproject):
        try:
            with open(pyproject, encoding="utf-8") as fh:
                name = _toml_project_name(fh.read())
        except OSError:
            name = None
        if name:
            return name, "pyproject.toml"
    setup_cfg = os.path.join(rootdir, "setup.cfg")
    if os.path.isfile(setup_cfg):
        import configparser  # only for a project that has a setup.cfg

        parser = configparser.ConfigParser()
        try:
            parser.read(setup_cfg, encoding="utf-8")
            name = parser.get("metadata", "name", fallback="").strip()
        except (configparser.Error, OSError):
            name = ""
        if name:
            return name, "setup.cfg"
    return None


def _distribution(name: str) -> Any:
    from importlib import metadata

    normalized = re.sub(r"[-_.]+", "-", name).lower()
    for candidate in dict.fromkeys((name, normalized, normalized.replace("-", "_"))):
        try:
            return metadata.distribution(candidate)
        except metadata.PackageNotFoundError:
            continue
    return None


def _top_level_from_files(dist: Any) -> list[str]:
    names: list[str] = []
    for path in dist.files or ():
        parts = path.parts
        if not parts or parts[0] in ("..", "__pycache__") or parts[0].endswith((".dist-info", ".egg-info", ".data")):
            continue
        head = parts[0]
        if head.startswith("__editable__") or head.endswith(".pth"):
            continue
        if len(parts) == 1:
            if head.endswith(".py") and head[:-3].isidentifier():
                names.append(head[:-3])
        elif head.isidentifier():
            names.append(head)
    return list(dict.fromkeys(names))


def import_packages(dist_name: str) -> list[tuple[str, tuple[str, ...]]]:
    """``(import name, install locations)`` of each top-level package the installed distribution provides.

    Empty when the distribution is not installed (its files then live in the
    rootdir, which is the user's code anyway).
    """
    dist = _distribution(dist_name)
    if dist is None:
        return []
    names: list[str] = []
    try:
        text = dist.read_text("top_level.txt") or ""
    except Exception:  # noqa: BLE001 - a broken metadata directory
        text = ""
    names.extend(line.strip() for line in text.splitlines() if line.strip().isidentifier())
    try:
        names.extend(_top_level_from_files(dist))
    except Exception:  # noqa: BLE001
        pass
    out = []
    for name in dict.fromkeys(names):
        paths = []
        for candidate in (name, f"{name}.py"):
            try:
                located = str(dist.locate_file(candidate))
            except Exception:  # noqa: BLE001
                continue
            if os.path.exists(located):
                paths.append(located)
        out.append((name, tuple(paths)))
    return out


def check_names(names: Sequence[str], where: str) -> tuple[str, ...]:
    """Validate package names given by the user; :class:`UsageError` naming the first bad one."""
    out = []
    for raw in names:
        name = raw.strip()
        if not name:
            continue
        if not _IMPORT_NAME.match(name):
            fixed = re.sub(r"[^A-Za-z0-9_.]", "_", name)
            hint = f" (did you mean {fixed!r}?)" if _IMPORT_NAME.match(fixed) else ""
            raise UsageError(
                f"pytest-torchperf: {where} entry {name!r} is not an import name like 'mypkg' or 'mypkg.sub'{hint}"
            )
        from ..stacks import package_locations

        if name not in sys.modules and not package_locations(name):
            known = sorted(set(_importable_names()))
            raise UsageError(
                f"pytest-torchperf: {where} names {name!r}, which is not importable here{suggest(name, known)}"
            )
        out.append(name)
    return tuple(dict.fromkeys(out))


def _importable_names() -> list[str]:
    import pkgutil

    try:
        return [m.name for m in pkgutil.iter_modules()]
    except Exception:  # noqa: BLE001  # pragma: no cover
        return []


def user_packages(
    rootdir: str, named: Sequence[str] = (), named_by: str = "torchperf_user_packages"
) -> list[UserPackage]:
    """The user's packages: the rootdir project's import packages, then the ones ``named`` in the settings."""
    from ..stacks import UserPackage

    out: list[UserPackage] = []
    declared = project_name(rootdir)
    if declared is not None:
        dist_name, source = declared
        rule = f"the project under test ({source} at the rootdir names {dist_name!r})"
        for name, paths in import_packages(dist_name):
            out.append(UserPackage(name, rule, paths))
    seen = {p.name for p in out}
    for name in named:
        if name not in seen:
            out.append(UserPackage(name, f"named by {named_by}"))
    return out
