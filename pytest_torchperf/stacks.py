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
from dataclasses import dataclass
from typing import Optional, Sequence, Union

__all__ = ["Frame", "Stack", "capture", "site_of", "format_stack", "display_path", "until_user_frame"]

# Frame kinds, from "never interesting" to "the user's own line".
TORCHPERF = "torchperf"
PYTEST = "pytest"
STDLIB = "stdlib"
TORCH = "torch"
FRAMEWORK = "framework"
LIBRARY = "library"
USER = "user"

#: Packages whose frames are the training framework's own code, not the user's.
FRAMEWORK_PACKAGES = (
    "pytorch_lightning",
    "lightning",
    "lightning_fabric",
    "lightning_utilities",
    "torchmetrics",
)
_PYTEST_PACKAGES = ("_pytest", "pytest", "pluggy", "xdist", "execnet")
_TORCH_PACKAGES = ("torch", "functorch")


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
Stack = tuple


class _Classifier:
    """Maps a file name to a frame kind, by the directories packages live in."""

    def __init__(self) -> None:
        self._cache: dict[str, str] = {}
        self._roots: Optional[list[tuple[str, str]]] = None
        self._prefixes: Optional[list[tuple[str, str]]] = None

    def _package_dir(self, name: str) -> Optional[str]:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if not path:
            return None
        return os.path.dirname(os.path.realpath(path)) + os.sep

    def _build(self) -> None:
        roots: list[tuple[str, str]] = []
        own = os.path.dirname(os.path.realpath(__file__)) + os.sep
        roots.append((own, TORCHPERF))
        for kind, names in ((TORCH, _TORCH_PACKAGES), (FRAMEWORK, FRAMEWORK_PACKAGES), (PYTEST, _PYTEST_PACKAGES)):
            for name in names:
                root = self._package_dir(name)
                if root:
                    roots.append((root, kind))
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
        for d in site_dirs:
            if d:
                prefixes.append((os.path.realpath(d) + os.sep, LIBRARY))
        for key in ("stdlib", "platstdlib"):
            d = sysconfig.get_paths().get(key)
            if d:
                prefixes.append((os.path.realpath(d) + os.sep, STDLIB))
        prefixes.sort(key=lambda item: len(item[0]), reverse=True)
        self._prefixes = prefixes

    def __call__(self, filename: str) -> str:
        kind = self._cache.get(filename)
        if kind is not None:
            return kind
        if self._roots is None:
            self._build()
        assert self._roots is not None and self._prefixes is not None
        if filename.startswith("<"):
            # "<frozen ...>" is the import system, "<string>" exec'd bootstrap code (xdist's
            # workers); other pseudo-files ("<stdin>", notebook cells) are the user's.
            kind = STDLIB if filename.startswith(("<frozen", "<string>")) else USER
        else:
            path = os.path.realpath(filename)
            kind = USER
            for root, root_kind in self._roots:
                if path.startswith(root):
                    kind = root_kind
                    break
            else:
                for prefix, prefix_kind in self._prefixes:
                    if path.startswith(prefix):
                        kind = prefix_kind
                        break
        self._cache[filename] = kind
        return kind

    def reset(self) -> None:
        """Forget package locations (a package imported later gets classified)."""
        self._cache.clear()
        self._roots = None
        self._prefixes = None


classify = _Classifier()


def capture(skip: int = 1) -> Stack:
    """The calling stack as :class:`Frame` objects, outermost first.

    ``skip`` frames are dropped from the inner end (1: this function's caller
    is the innermost frame kept... plus ``capture`` itself).
    """
    frame = sys._getframe(skip)
    frames = []
    while frame is not None:
        frames.append(Frame(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    frames.reverse()
    return tuple(frames)


_NOT_A_SITE = (TORCHPERF, TORCH, STDLIB, PYTEST)


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


def set_display_root(path: str) -> None:
    """Show user files relative to ``path`` (pytest's rootdir)."""
    root = os.path.realpath(path) + os.sep
    if root not in _display_roots:
        _display_roots.insert(0, root)


def display_path(filename: str) -> str:
    """A short, still unambiguous path for a report line."""
    if filename.startswith("<"):
        return filename
    path = os.path.realpath(filename)
    candidates = list(_display_roots) + [os.path.realpath(os.getcwd()) + os.sep]
    if classify(filename) in (USER,):
        for root in candidates:
            if path.startswith(root):
                return path[len(root):]
        return path
    # Library code: relative to the directory that holds the package.
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


def format_stack(
    stack: Sequence[Frame],
    *,
    verbose: bool = False,
    indent: str = "    ",
    tail: int = 6,
) -> list[str]:
    """Render ``stack`` (outermost first), user frames marked with ``>``.

    By default only user, framework and library frames are shown: every user
    frame, the frame it calls into, and the innermost ``tail`` frames; the
    rest is folded into "... N frames hidden". ``verbose`` shows every frame.
    """
    entries: list[Union[Frame, int]]
    if verbose:
        entries = [f for f in stack if f.kind != TORCHPERF]
    else:
        kept = [f for f in stack if _keep(f)] or list(stack[-1:])
        entries = _trim(kept, tail)
    lines = []
    for entry in entries:
        if isinstance(entry, int):
            lines.append(f"{indent}  ... {entry} frames hidden (-v shows the whole stack)")
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
