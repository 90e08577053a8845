"""Cheap stack capture, frame classification and stack formatting.

A stack is captured as plain ``(filename, lineno, function)`` triples walking
``sys._getframe``; source lines are only read when a report is rendered.
Every frame is classified by where its file lives, so reports can point at the
user's line and trim the frames that do not matter.
"""

from __future__ import annotations

import linecache
import os
import site
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Optional, Union

from .frameworks import PACKAGES as _ADAPTED

__all__ = [
    "Frame",
    "Stack",
    "UserPackage",
    "capture",
    "classify",
    "display_path",
    "format_stack",
    "package_locations",
    "show_full_stacks",
    "site_of",
    "until_user_frame",
]

# Frame kinds, from "never interesting" to "the user's own line".
TORCHPERF = "torchperf"
PYTEST = "pytest"
#: A console-script launcher (a venv's ``bin/pytest``): how the process started, never the user's code.
LAUNCHER = "launcher"
STDLIB = "stdlib"
TORCH = "torch"
FRAMEWORK = "framework"
LIBRARY = "library"
USER = "user"

#: Packages whose frames are a training framework's own code, not the user's: every adapter's ``PACKAGES``.
#: (torchmetrics is a library the user calls from their own step: its syncs there are judged at the user's
#: calling line, so no adapter claims it.)
FRAMEWORK_PACKAGES: tuple[str, ...] = _ADAPTED
_PYTEST_PACKAGES = ("_pytest", "pytest", "pluggy", "xdist", "execnet")
_TORCH_PACKAGES = ("torch", "functorch")
#: Every package the classifier places by its import location.
_NAMED_PACKAGES = _TORCH_PACKAGES + FRAMEWORK_PACKAGES + _PYTEST_PACKAGES


@dataclass(frozen=True)
class Frame:
    filename: str
    lineno: int
    function: str

    @property
    def kind(self) -> str:
        return classify(self.filename)

    @property
    def is_user(self) -> bool:
        return self.kind == USER

    @property
    def source(self) -> str:
        return linecache.getline(self.filename, self.lineno).strip()

    def location(self) -> str:
        return f"{display_path(self.filename)}:{self.lineno}"


#: Outermost frame first, innermost (the event) last.
Stack = tuple[Frame, ...]


@dataclass(frozen=True)
class UserPackage:
    """A package that is the user's own code wherever it is installed (site-packages included).

    ``name`` is its import name (``"mypkg"``, ``"acme.tools"``); ``rule`` says
    why it counts as the user's code (shown in reports); ``paths`` are install
    locations known from its distribution's metadata (directories or ``.py``
    files), looked at beside wherever the name is importable from now.
    """

    name: str
    rule: str
    paths: tuple[str, ...] = ()


#: Directory names that hold installed distributions: a library lives below one of them.
_SITE_NAMES = ("site-packages", "dist-packages")
#: Directory names that hold console scripts (``pytest``, ``torchrun``...) in an environment.
_SCRIPT_DIRS = ("bin", "Scripts")


def _is_launcher(path: str, script_dirs: frozenset[str]) -> bool:
    """``path`` is a console script: in an environment's scripts directory (a venv's ``bin/``, the
    interpreter's own), that is, a directory named ``bin`` whose parent holds ``pyvenv.cfg``."""
    directory = os.path.dirname(path)
    if directory + os.sep in script_dirs:
        return True
    return os.path.basename(directory) in _SCRIPT_DIRS and os.path.isfile(
        os.path.join(os.path.dirname(directory), "pyvenv.cfg")
    )


class _Classifier:
    """Maps a file name to a frame kind, by the directories packages live in.

    In order: torchperf's own files; the user's packages (:meth:`set_user_packages`:
    the project under test and the packages named in the settings, user code
    even when installed in site-packages); torch, the frameworks and pytest by
    package; then anything below a site-packages directory is a library and
    anything below the standard library is the standard library; the rest is
    the user's. :meth:`rule` says which of these rules decided a file.
    """

    def __init__(self) -> None:
        self._cache: dict[str, str] = {}
        self._roots: Optional[list[tuple[str, str]]] = None
        self._prefixes: Optional[list[tuple[str, str]]] = None
        #: The running interpreter's scripts directories (where ``pytest`` and other launchers live).
        self._script_dirs: frozenset[str] = frozenset()
        self._user_packages: tuple[UserPackage, ...] = ()
        #: Root directory (or exact ``.py`` file) -> the user package it belongs to.
        self._user_roots: dict[str, UserPackage] = {}
        #: What the tables were built from (see :meth:`refresh`).
        self._built_from: Optional[tuple[object, ...]] = None

    # -- configuration ---------------------------------------------------------------------
    def set_user_packages(self, packages: Sequence[UserPackage]) -> tuple[UserPackage, ...]:
        """Count these packages as the user's code from now on; returns the previous setting."""
        previous = self._user_packages
        self._user_packages = tuple(packages)
        self.reset()
        return previous

    @property
    def user_packages(self) -> tuple[UserPackage, ...]:
        return self._user_packages

    def _package_dir(self, name: str) -> Optional[str]:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if not path:
            return None
        return os.path.dirname(os.path.realpath(str(path))) + os.sep

    def _user_locations(self, package: UserPackage) -> list[str]:
        """Where ``package`` is installed: its known paths and wherever it is importable from now."""
        found = [p for p in package.paths if p]
        module = sys.modules.get(package.name)
        if module is not None:
            found.extend(getattr(module, "__path__", None) or [])
            if getattr(module, "__file__", None) and not hasattr(module, "__path__"):
                found.append(str(module.__file__))
        else:
            found.extend(package_locations(package.name))
        out = []
        for path in found:
            try:
                real = os.path.realpath(path)
            except (OSError, ValueError):  # pragma: no cover
                continue
            out.append(real + os.sep if os.path.isdir(real) else real)
        return out

    def _inputs(self) -> Optional[tuple[object, ...]]:
        """What the tables depend on that can change in a process: the user packages, ``sys.path`` and which
        of the packages they name are imported (the module objects themselves, compared by identity). None
        when a user package is not imported: its location is then looked up on disk, where it may appear at
        any time."""
        modules = sys.modules
        users = tuple(modules.get(p.name) for p in self._user_packages)
        if None in users:
            return None
        named = tuple(modules.get(name) for name in _NAMED_PACKAGES)
        return (self._user_packages, tuple(sys.path), users, named)

    def _build(self) -> None:
        self._built_from = self._inputs()
        roots: list[tuple[str, str]] = []
        own = os.path.dirname(os.path.realpath(__file__)) + os.sep
        roots.append((own, TORCHPERF))
        self._user_roots = {}
        for package in self._user_packages:
            for root in self._user_locations(package):
                if root != own and not own.startswith(root):
                    self._user_roots.setdefault(root, package)
        for kind, names in ((TORCH, _TORCH_PACKAGES), (FRAMEWORK, FRAMEWORK_PACKAGES), (PYTEST, _PYTEST_PACKAGES)):
            for name in names:
                package_dir = self._package_dir(name)
                if package_dir and package_dir not in self._user_roots:
                    roots.append((package_dir, kind))
        roots.extend((root, USER) for root in self._user_roots)
        # Longest root first, so a package inside another one wins.
        roots.sort(key=lambda item: len(item[0]), reverse=True)
        self._roots = roots
        prefixes: list[tuple[str, str]] = []
        site_dirs = set()
        for key in ("purelib", "platlib"):
            site_dirs.add(sysconfig.get_paths().get(key, ""))
        try:
            site_dirs.update(site.getsitepackages())
        except AttributeError:  # pragma: no cover - old virtualenv
            pass
        try:
            site_dirs.add(site.getusersitepackages())
        except AttributeError:  # pragma: no cover
            pass
        # Any other site directory on the path (a tox or nox environment, a --target install).
        site_dirs.update(
            p for p in sys.path if isinstance(p, str) and os.path.basename(p.rstrip(os.sep)) in _SITE_NAMES
        )
        for d in site_dirs:
            if d:
                prefixes.append((os.path.realpath(d) + os.sep, LIBRARY))
        for key in ("stdlib", "platstdlib"):
            std = sysconfig.get_paths().get(key)
            if std:
                prefixes.append((os.path.realpath(std) + os.sep, STDLIB))
        prefixes.sort(key=lambda item: len(item[0]), reverse=True)
        self._prefixes = prefixes
        scripts = {sysconfig.get_paths().get("scripts", "")} | {os.path.dirname(sys.executable)}
        self._script_dirs = frozenset(os.path.realpath(d) + os.sep for d in scripts if d)

    def __call__(self, filename: str) -> str:
        kind = self._cache.get(filename)
        if kind is not None:
            return kind
        if self._roots is None:
            self._build()
        assert self._roots is not None and self._prefixes is not None
        if filename.startswith("<"):
            # "<frozen ...>" is the import system (runpy's ``python -m`` entry included), "<string>"
            # exec'd bootstrap code (xdist's workers); other pseudo-files ("<stdin>", notebook cells) are
            # the user's.
            kind = STDLIB if filename.startswith(("<frozen", "<string>")) else USER
        else:
            path = os.path.realpath(filename)
            kind = USER if path in self._user_roots else self._kind_of(path)
            if kind == USER and _is_launcher(path, self._script_dirs):
                kind = LAUNCHER
        self._cache[filename] = kind
        return kind

    def _kind_of(self, path: str) -> str:
        assert self._roots is not None and self._prefixes is not None
        for root, root_kind in self._roots:
            if path.startswith(root):
                return root_kind
        for prefix, prefix_kind in self._prefixes:
            if path.startswith(prefix):
                return prefix_kind
        return USER

    def _user_package_of(self, path: str) -> Optional[UserPackage]:
        package = self._user_roots.get(path)
        if package is not None:
            return package
        best = None
        for root, candidate in self._user_roots.items():
            if root.endswith(os.sep) and path.startswith(root) and (best is None or len(root) > len(best[0])):
                best = (root, candidate)
        return best[1] if best else None

    def _installed(self, path: str) -> bool:
        assert self._prefixes is not None
        return any(path.startswith(prefix) for prefix, kind in self._prefixes if kind == LIBRARY)

    def rule(self, filename: str) -> str:
        """Which rule classified ``filename``, in words (for reports)."""
        kind = self(filename)
        if filename.startswith("<"):
            return "code without a file: your code" if kind == USER else "the import system"
        path = os.path.realpath(filename)
        if kind == USER:
            package = self._user_package_of(path)
            if package is not None:
                where = " installed in site-packages" if self._installed(path) else ""
                return f"package {package.name}{where}: {package.rule}"
            return "outside site-packages and the standard library: your code"
        if kind == LIBRARY:
            return "installed in site-packages: a library (name it in torchperf_user_packages if it is yours)"
        return {
            FRAMEWORK: "the training framework's own code",
            TORCH: "torch's own code",
            PYTEST: "pytest's own code",
            STDLIB: "the Python standard library",
            TORCHPERF: "pytest-torchperf's own code",
            LAUNCHER: "a console-script launcher (how the process started)",
        }.get(kind, kind)

    def rule_matters(self, filename: str) -> bool:
        """Whether ``filename`` is the user's only because a user-package rule says so (it is installed)."""
        if self(filename) != USER or filename.startswith("<"):
            return False
        path = os.path.realpath(filename)
        return self._user_package_of(path) is not None and self._installed(path)

    def reset(self) -> None:
        """Forget package locations (a package imported later gets classified)."""
        self._cache.clear()
        self._roots = None
        self._prefixes = None
        self._built_from = None
        _displayed.clear()

    def refresh(self) -> None:
        """:meth:`reset`, unless nothing the tables were built from has changed since (a watch starts: a
        package imported since, a new ``sys.path`` entry, other user packages are seen; building the tables
        costs about a millisecond of path look-ups, and every file name met is looked up again after it)."""
        if self._built_from is None or self._built_from != self._inputs():
            self.reset()


def package_locations(name: str) -> list[str]:
    """Where ``name`` (``"pkg"`` or ``"pkg.sub"``) would be imported from, without importing it."""
    from importlib.machinery import PathFinder

    parts = name.split(".")
    try:
        spec = PathFinder.find_spec(parts[0])
    except (ImportError, ValueError):  # pragma: no cover - a broken path entry
        return []
    if spec is None:
        return []
    locations = list(spec.submodule_search_locations or [])
    if not locations:
        return [spec.origin] if spec.origin and len(parts) == 1 else []
    for part in parts[1:]:
        found = []
        for base in locations:
            candidate = os.path.join(base, part)
            if os.path.isdir(candidate):
                found.append(candidate)
            elif os.path.isfile(candidate + ".py"):
                return [candidate + ".py"] if part == parts[-1] else []
        locations = found
    return locations


classify = _Classifier()


def capture(skip: int = 1) -> Stack:
    """The calling stack as :class:`Frame` objects, outermost first.

    ``skip`` frames are dropped from the inner end (1: this function's caller
    is the innermost frame kept... plus ``capture`` itself).
    """
    frame: Optional[FrameType] = sys._getframe(skip)
    frames = []
    while frame is not None:
        frames.append(Frame(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    frames.reverse()
    return tuple(frames)


_NOT_A_SITE = (TORCHPERF, TORCH, STDLIB, PYTEST, LAUNCHER)


def site_of(stack: Sequence[Frame]) -> Optional[Frame]:
    """The innermost frame outside torch, the standard library, pytest and torchperf.

    That is the line an event is attributed to: the user's own line, or the
    framework's line when a framework did it.
    """
    for frame in reversed(stack):
        if frame.kind not in _NOT_A_SITE:
            return frame
    return stack[-1] if stack else None


_display_roots: list[str] = []
#: ``(file name, working directory)`` -> its display path, while the classifier's tables stand (a report
#: shows each file many times, and every real path is a look-up of each directory on the way).
_displayed: dict[tuple[str, str], str] = {}


def set_display_root(path: str) -> None:
    """Show user files relative to ``path`` (pytest's rootdir)."""
    root = os.path.realpath(path) + os.sep
    if root not in _display_roots:
        _display_roots.insert(0, root)
        _displayed.clear()


def display_path(filename: str) -> str:
    """A short, still unambiguous path for a report line."""
    if filename.startswith("<"):
        return filename
    cwd = os.getcwd()
    key = (filename, cwd)
    shown = _displayed.get(key)
    if shown is None:
        if len(_displayed) > 5000:  # (the classifier's reset() empties it too)
            _displayed.clear()
        shown = _displayed[key] = _display_path(filename, cwd)
    return shown


def _display_path(filename: str, cwd: str) -> str:
    path = os.path.realpath(filename)
    candidates = list(_display_roots) + [os.path.realpath(cwd) + os.sep]
    if classify(filename) in (USER,):
        for root in candidates:
            if path.startswith(root):
                return path[len(root):]
    # Installed code (a library, or a user package in site-packages): relative to the directory that holds it.
    assert classify._prefixes is not None
    for prefix, _ in classify._prefixes:
        if path.startswith(prefix):
            return path[len(prefix):]
    return path


def _keep(frame: Frame) -> bool:
    return frame.kind in (USER, FRAMEWORK, LIBRARY)


def _trim(kept: Sequence[Frame], tail: int) -> list[Union[Frame, int]]:
    """Keep every user frame, the frame each user frame calls into, and the innermost ``tail`` frames.

    Each run of dropped frames becomes its length (rendered as "... N frames hidden").
    """
    keep = set(range(max(len(kept) - tail, 0), len(kept)))
    for i, frame in enumerate(kept):
        if frame.is_user:
            keep.update((i, i + 1))
    out: list[Union[Frame, int]] = []
    for i, frame in enumerate(kept):
        if i in keep:
            out.append(frame)
        elif out and isinstance(out[-1], int):
            out[-1] += 1
        else:
            out.append(1)
    return out


#: Whether reports show every frame (``--torchperf-full-stacks``); see :func:`show_full_stacks`.
_full_stacks = [False]
#: What a folded stack says about the frames it hides.
HIDDEN_HINT = "--torchperf-full-stacks shows the whole stack"


def show_full_stacks(full: bool) -> bool:
    """Render every frame of every stack from now on (or fold them again); returns the previous setting."""
    previous = _full_stacks[0]
    _full_stacks[0] = full
    return previous


def format_stack(
    stack: Sequence[Frame],
    *,
    full: Optional[bool] = None,
    indent: str = "    ",
    tail: int = 6,
) -> list[str]:
    """Render ``stack`` (outermost first), user frames marked with ``>``.

    Whatever the verbosity, only user, framework and library frames are shown
    (pytest's, pluggy's, torchperf's own and the launcher's never are): every
    user frame, the frame it calls into, and the innermost ``tail`` frames; the
    rest is folded into "... N frames hidden". ``full`` (default: the session's
    ``--torchperf-full-stacks``) shows every frame but torchperf's own.
    """
    entries: list[Union[Frame, int]]
    if _full_stacks[0] if full is None else full:
        entries = [f for f in stack if f.kind != TORCHPERF]
    else:
        kept = [f for f in stack if _keep(f)] or list(stack[-1:])
        if kept and kept[-1] is not stack[-1]:
            # the event happened inside torch's own Python code (a module's forward checking a mask): its
            # innermost torch frames show what did it
            last = max(i for i, f in enumerate(stack) if f is kept[-1])
            kept += [f for f in stack[last + 1:] if f.kind == TORCH]
        entries = _trim(kept, tail)
    lines = []
    for entry in entries:
        if isinstance(entry, int):
            lines.append(f"{indent}  ... {entry} frames hidden ({HIDDEN_HINT})")
            continue
        mark = ">" if entry.is_user else " "
        lines.append(f"{indent}{mark} {entry.location()} in {entry.function}")
        src = entry.source
        if src:
            lines.append(f"{indent}      {src}")
    return lines


def until_user_frame(stack: Stack) -> Stack:
    """``stack`` cut after its innermost user frame, so the user's line is the site.

    A loader built in ``train_dataloader()`` goes through Lightning's own
    ``__init__`` wrapper; the line worth showing is the user's ``DataLoader(...)``.
    """
    for i in range(len(stack) - 1, -1, -1):
        if stack[i].is_user:
            return stack[: i + 1]
    return stack
