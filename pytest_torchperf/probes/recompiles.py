"""Probe ``recompiles``: dynamo's recompilations, with the guards that failed, and its compile starts.

Patches two functions in ``torch._dynamo.convert_frame`` (now if dynamo is
imported, else as soon as it is): ``get_and_maybe_log_recompilation_reasons``,
called on every recompile with the failing guards (the same text
``TORCH_LOGS=recompiles`` prints), which sends ``on_recompile(code, reasons,
stack)``, and ``exceeds_recompile_limit``, which sends
``on_recompile_limit(name)`` when a limit is hit. Compiles are counted with
dynamo's compile-start callback (``on_compile()``). Nothing changes dynamo's
behaviour or logging. ``torch._dynamo.reset()`` clears dynamo's callbacks: the
probe registers its own again after it and sends ``on_dynamo_reset()``.
:attr:`RecompilesProbe.attached` says whether this torch's
dynamo has the hooks it reads (None: dynamo was never imported).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Callable

from .. import core
from ..core import FLAGS
from ..patching import wraps
from ..stacks import capture
from . import ModuleProbe

if TYPE_CHECKING:
    from ..patching import Patcher

__all__ = ["RecompilesProbe"]

_CONVERT_FRAME = "torch._dynamo.convert_frame"
#: Names across torch versions (newest first).
_REASONS = ("get_and_maybe_log_recompilation_reasons", "get_and_maybe_log_recompilation_reason")
_LIMITS = ("exceeds_recompile_limit", "exceeds_cache_size_limit")


class RecompilesProbe(ModuleProbe):
    name = "recompiles"
    module = _CONVERT_FRAME

    def _attach(self, patcher: Patcher, convert_frame: Any) -> None:
        """Patch dynamo's recompilation entry points in ``convert_frame``."""
        flags = FLAGS
        probe = self
        reasons_name = next((n for n in _REASONS if callable(getattr(convert_frame, n, None))), None)
        limit_name = next((n for n in _LIMITS if callable(getattr(convert_frame, n, None))), None)
        self.attached = reasons_name is not None
        if reasons_name is None:
            self.unavailable["recompiles"] = "this torch version's dynamo has no recompilation hook torchperf knows"
            return

        def wrap_reasons(original: Callable[..., Any]) -> Callable[..., Any]:
            @wraps(original)
            def reasons(*args: Any, **kwargs: Any) -> Any:
                out = original(*args, **kwargs)
                if flags.active and not kwargs.get("skip_logging"):
                    try:
                        frame = args[1] if len(args) > 1 else kwargs.get("frame")
                        code = getattr(frame, "f_code", None)
                        if code is not None and core.handlers("on_recompile"):
                            found = [str(r) for r in (out or [])] if isinstance(out, (list, tuple)) else [str(out)]
                            core.notify("on_recompile", code, found, capture(2))
                    except Exception as exc:  # noqa: BLE001 - never into the user's code
                        probe.failed(exc)
                return out

            return reasons

        def wrap_limit(original: Callable[..., Any]) -> Callable[..., Any]:
            @wraps(original)
            def exceeds(*args: Any, **kwargs: Any) -> Any:
                out = original(*args, **kwargs)
                try:
                    exceeded, which = (out[0], out[1]) if isinstance(out, tuple) else (bool(out), "cache_size_limit")
                    if exceeded and flags.active:
                        core.notify("on_recompile_limit", which or "recompile_limit")
                except Exception as exc:  # noqa: BLE001
                    probe.failed(exc)
                return out

            return exceeds

        patcher.wrap(convert_frame, reasons_name, wrap_reasons)
        if limit_name is not None:
            patcher.wrap(convert_frame, limit_name, wrap_limit)

        try:
            callback_module: Any = importlib.import_module("torch._dynamo.callback")
        except ImportError:  # pragma: no cover - torch without compile callbacks
            callback_module = None
        handler = getattr(callback_module, "callback_handler", None)
        if handler is not None and hasattr(handler, "register_start_callback"):

            def on_start(args: Any) -> None:
                trigger = getattr(getattr(args, "callback_trigger", None), "name", "DYNAMO")
                if flags.active and not probe.disabled and trigger == "DYNAMO":
                    core.notify("on_compile")

            handler.register_start_callback(on_start)
            self._keep_across_reset(patcher, handler, on_start)

            def remove() -> None:
                try:
                    handler.remove_start_callback(on_start)
                except ValueError:  # already cleared by someone else
                    pass

            patcher.callback(remove, deferred=True)


    def _keep_across_reset(self, patcher: Patcher, handler: Any, on_start: Callable[[Any], None]) -> None:
        """``torch._dynamo.reset()`` clears every compile callback: register ``on_start`` again after it.

        Sends ``on_dynamo_reset()``: dynamo's caches are empty, its next compiles are first compiles.
        """
        clear = getattr(type(handler), "clear", None)
        if not callable(clear):
            return
        probe = self

        def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
            @wraps(original)
            def clear(this: Any, *args: Any, **kwargs: Any) -> Any:
                out = original(this, *args, **kwargs)
                if this is handler and not probe.disabled:
                    try:
                        this.register_start_callback(on_start)
                        if FLAGS.active:
                            core.notify("on_dynamo_reset")
                    except Exception as exc:  # noqa: BLE001 - never into the user's code
                        probe.failed(exc)
                return out

            return clear

        patcher.wrap(type(handler), "clear", wrap)
