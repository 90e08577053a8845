"""Probe ``graphs``: a sample of the backward passes, with the autograd graphs they are about to traverse.

Every ``loss.backward()`` and ``torch.autograd.grad(...)`` reaches torch's
``torch.autograd._engine_run_backward`` (on torch < 2.3, without it:
``torch.autograd.backward`` and ``torch.autograd.grad``), which is wrapped. A
*sampled* call sends ``on_backward_sample(roots)`` to the checks of the active
runs, ``roots`` being the graph nodes (``grad_fn``) the pass starts from, before
torch runs it: the whole graph is still there, saved tensors included.

Sampling keeps the cost bounded whatever the graph's size: the first backward
pass of a run is sampled, then the next sampled one is the first to come after
``cost / BUDGET`` seconds, ``cost`` being what the last sampled one cost the
checks (they walk the graph). The checks' work is thus at most about
``BUDGET`` (0.5%) of the run's time, whether a step takes 200 us or 2 s; the
unsampled calls pay a clock read and a comparison. A sample's cost is the CPU
time the checks took, less the garbage collections run meanwhile (180-260 ms in
a process with torch and Lightning loaded), and one far above the run's usual
cost counts at most ``SPIKE`` times that: counted whole, a collection, a cold
cache or the core lost for a while on a busy machine put the next sample 200
times that far away, past the rest of most runs. Passes started by the
autograd engine itself (reentrant checkpointing) are never sampled.

In the steps whose backward pass is due to be sampled, a check may also see every
module's output as it is built (:meth:`GraphsProbe.arm_forward`: a global module
forward hook, registered for that step only): an output that is not part of the
loss (an auxiliary head, predictions kept for an epoch-end metric) shares no
node with the backward pass and would otherwise never be tagged.

It also counts optimizer steps, cheaply: :meth:`GraphsProbe.await_optimizer_step`
arms a one-shot global optimizer step post-hook (registered when armed,
removed at the next backward pass after it fired), so a check that tagged a
step's graph learns when that step's optimizer step has run without every
optimizer step paying for a hook.

The probe also lends the check a *creation trace* for one training step
(:meth:`GraphsProbe.trace_creations`): torch's anomaly mode without its NaN
checks, which makes torch store the Python stack of every graph node built
meanwhile in the node's ``metadata["traceback_"]``. It changes no value and
no result; it is only switched on once a run has already broken the
invariant, to name the line that built what is retained.
"""

from __future__ import annotations

import gc
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional

from .. import core
from ..clocks import perf_counter, thread_time
from ..core import FLAGS
from ..patching import wraps
from . import Probe, is_compiling_function

if TYPE_CHECKING:
    from ..patching import Patcher

__all__ = ["GraphsProbe", "roots_of"]

#: The share of the run's time the sampled graph walks may take.
BUDGET = 0.005
#: A sample's cost sets the next one's distance up to this many times the mean cost of the run's samples so far.
SPIKE = 4.0


def _eval_frame_setter() -> Optional[Callable[[Any], Any]]:
    """Dynamo's ``set_eval_frame`` (C), when dynamo is imported: None and the frame callback is off."""
    import sys

    eval_frame = sys.modules.get("torch._C._dynamo.eval_frame")
    setter = getattr(eval_frame, "set_eval_frame", None)
    return setter if callable(setter) else None


def roots_of(outputs: Any) -> tuple[Any, ...]:
    """The graph nodes a backward pass over ``outputs`` (tensors or GradientEdges) starts from."""
    if not isinstance(outputs, (list, tuple)):
        outputs = (outputs,)
    roots = []
    for out in outputs:
        node = getattr(out, "grad_fn", None)
        if node is None:
            node = getattr(out, "node", None)  # a GradientEdge
        if node is not None:
            roots.append(node)
    return tuple(roots)


class GraphsProbe(Probe):
    """The wrapped backward entry point (see the module's docstring)."""

    name = "graphs"

    def __init__(self) -> None:
        super().__init__()
        #: Callbacks given each module output while armed (see :meth:`arm_forward`), and the hook's handle:
        #: not part of :meth:`reset`, which runs before the deferred :meth:`_remove_forward_hook` when the probe
        #: is taken out mid-run (a handle dropped there left the global hook registered for good).
        self._forward_callbacks: list[Callable[[Any], None]] = []
        self._forward_hook: Any = None
        #: Dynamo's compile start and end callbacks while the forward hook is registered (handler, start, end).
        self._compile_callbacks: Any = None
        self.reset()
        #: The garbage collector's callback, one object for every watch of the process (see :meth:`_collected`).
        self._on_gc = self._collected

    def reset(self) -> None:
        super().reset()
        #: Backward passes seen while a run was active, and how many of them were sampled.
        self.calls = 0
        self.samples = 0
        #: Seconds the checks spent on the sampled passes.
        self.sample_seconds = 0.0
        #: The clock value from which the next backward pass is sampled.
        self.next_due = 0.0
        #: Anomaly mode switched on by :meth:`trace_creations`: ``(enabled, check_nan)`` to restore.
        self._restore: Optional[tuple[bool, bool]] = None
        #: Optimizer steps counted by the one-shot hook (see :meth:`await_optimizer_step`), and the optimizers seen.
        self.optimizer_steps = 0
        self.optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
        self._armed = False
        self._hook: Any = None
        self._unhook = False
        self._current_node: Callable[[], Any] = lambda: None
        self._no_subclass_code: Any = None
        #: This thread's CPU seconds the armed module output callbacks took since the last sample (added to its
        #: cost; a callback that waited for a core cost no more).
        self.forward_seconds = 0.0
        #: The garbage collections run in the watch's thread: their CPU seconds (left out of a sample's cost),
        #: and the CPU clock at the start of the one under way.
        self.gc_cpu = 0.0
        self._gc_start = 0.0
        self._thread = 0
        #: Installed and not taken out: only then may a check's call register a global hook here.
        self._live = False

    def install(self, patcher: Patcher) -> None:
        """Wrap the backward entry point; undone by ``patcher``."""
        import torch
        import torch.autograd

        self.reset()
        patcher.callback(self.reset)
        self._thread = threading.get_ident()
        self._live = True
        gc.callbacks.append(self._on_gc)
        patcher.callback(self._remove_gc_callback)
        patcher.callback(self._remove_hook)
        patcher.callback(self._remove_forward_hook, deferred=True)
        patcher.callback(self.stop_tracing)  # undone first: anomaly mode back before the state is cleared
        flags = FLAGS
        probe = self
        self._hide_from_compile(patcher)
        is_compiling = is_compiling_function()
        clock = perf_counter
        self._current_node = getattr(torch._C, "_current_autograd_node", lambda: None)
        self._no_subclass_code = torch._C.DisableTorchFunctionSubclass

        def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
            @wraps(original)
            def run_backward(outputs: Any, *args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                # is_compiling() first: a traced wrapper must not read (and guard on) torchperf's state.
                if not is_compiling() and flags.active:
                    try:
                        probe.calls += 1
                        if probe._unhook:
                            probe._remove_hook()
                        start = clock()
                        if start >= probe.next_due:
                            probe.sample(outputs)
                    except Exception as exc:  # noqa: BLE001 - never into the user's code
                        probe.failed(exc)
                return original(outputs, *args, **kwargs)

            return run_backward

        if callable(getattr(torch.autograd, "_engine_run_backward", None)):
            patcher.wrap(torch.autograd, "_engine_run_backward", wrap)
        else:  # pragma: no cover - torch < 2.3
            patcher.wrap(torch.autograd, "backward", wrap)
            patcher.wrap(torch.autograd, "grad", wrap)

    def sample(self, outputs: Any) -> None:
        """A pass is due: hand its roots to the checks, time them, and set when the next one is."""
        if self._current_node() is not None:
            return  # started by the autograd engine itself (reentrant checkpointing)
        if not core.handlers("on_backward_sample"):
            return
        with self._no_subclass_code():  # read grad_fn without running a tensor subclass's __torch_function__
            roots = roots_of(outputs)
        if not roots:
            return
        # The walk's cost in this thread's CPU time, collections left out: on a machine shared with other work, a
        # walk preempted for a while cost no more, and counted in wall time it stopped the sampling for 200 times
        # that while (a run of 400 fast steps then walked its first backward pass only, and missed a leak that
        # began later). A cost far above the usual one (1 ms against 0.05 ms, now and then, in a long test
        # process) sets the next sample at most SPIKE times the usual cost away; a cost that grows with the graph
        # is followed.
        cpu = thread_time()
        collected = self.gc_cpu
        core.notify("on_backward_sample", roots)
        end = perf_counter()
        now = thread_time()
        cost = now - cpu - (self.gc_cpu - collected) + self.forward_seconds
        self.forward_seconds = 0.0
        if self.samples:
            cost_paced = min(cost, SPIKE * self.sample_seconds / self.samples)
        else:
            cost_paced = cost
        self.samples += 1
        self.sample_seconds += cost
        self.next_due = end + cost_paced / BUDGET

    # -- module outputs ------------------------------------------------------------------
    def arm_forward(self, callback: Callable[[Any], None]) -> None:
        """Give ``callback`` every module's output from now on, until :meth:`disarm_forward`."""
        if not self._live or self.disabled:
            return  # taken out (a failure of its own) or not installed: nothing would remove the hook
        if callback not in self._forward_callbacks:
            self._forward_callbacks.append(callback)
        if self._forward_hook is not None:
            return
        try:
            from torch.nn.modules.module import register_module_forward_hook
        except ImportError:  # pragma: no cover
            return
        probe = self
        callbacks = self._forward_callbacks
        is_compiling = is_compiling_function()

        set_eval_frame = _eval_frame_setter()

        def forward_hook(module: Any, args: Any, output: Any) -> None:
            if is_compiling():
                return
            start = thread_time()
            collected = probe.gc_cpu
            # Called by the module's ``_call_impl`` inside a compiled module's call (torch.compile(model)):
            # dynamo's frame callback is on, and would compile the torch functions the checks call.
            prior = set_eval_frame(None) if set_eval_frame is not None else None
            try:
                for fn in list(callbacks):
                    fn(output)
            except Exception as exc:  # noqa: BLE001 - never into the user's code
                probe.failed(exc)
            finally:
                if prior is not None and set_eval_frame is not None:
                    set_eval_frame(prior)
            # Counted in the budget at the next sample, in CPU time as the walks are. (Wall time bounded by the CPU
            # time since arming charged the user's own step to the callbacks: a callback preempted for 50 ms in
            # a first step of 4 ms of CPU put the next sample 0.8 s away.)
            probe.forward_seconds += thread_time() - start - (probe.gc_cpu - collected)

        self._forward_hook = register_module_forward_hook(forward_hook)
        self._follow_compiles()

    def disarm_forward(self, callback: Callable[[Any], None]) -> None:
        if callback in self._forward_callbacks:
            self._forward_callbacks.remove(callback)
        if not self._forward_callbacks:
            self._remove_forward_hook()

    def _remove_forward_hook(self) -> None:
        hook, self._forward_hook = self._forward_hook, None
        if hook is not None:
            hook.remove()
        self._forward_callbacks.clear()
        self._unfollow_compiles()

    # -- the forward hook, invisible to torch.compile --------------------------------------
    # A global module forward hook present while dynamo traces a module makes dynamo trace ``_call_impl``
    # and the hook (a graph break at torchperf's frame), and ``OptimizedModule.__call__`` warns about global
    # hooks (an error under ``-W error``). So the hook leaves torch's dict of global hooks while dynamo
    # compiles (its compile start and end callbacks) and comes back at once after, where it was;
    # ``_has_any_global_hook`` does not count it. Dynamo installs no guard on the global hooks: the code
    # compiled without it runs as it is with it back (tested: same graphs and compiles, watched or not).
    def _hide_from_compile(self, patcher: Patcher) -> None:
        try:
            import torch.nn.modules.module as module_module
        except ImportError:  # pragma: no cover
            return
        probe = self

        def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
            @wraps(original)
            def _has_any_global_hook(*args: Any, **kwargs: Any) -> Any:
                out = original(*args, **kwargs)
                hook = probe._forward_hook
                if out and hook is not None:
                    hooks = getattr(module_module, "_global_forward_hooks", {})
                    if hook.id in hooks and len(hooks) == 1:
                        # Ours is the only forward hook: the answer without it.
                        hooks_ours = hooks.pop(hook.id)
                        try:
                            return original(*args, **kwargs)
                        finally:
                            hooks[hook.id] = hooks_ours
                return out

            return _has_any_global_hook

        if callable(getattr(module_module, "_has_any_global_hook", None)):
            patcher.wrap(module_module, "_has_any_global_hook", wrap)

    def _follow_compiles(self) -> None:
        """While the forward hook is registered, take it out of torch's global hooks during each compile."""
        import sys

        handler = getattr(sys.modules.get("torch._dynamo.callback"), "callback_handler", None)
        if handler is None or self._compile_callbacks is not None:
            return
        hidden: list[Any] = []
        probe = self

        def start(_args: Any) -> None:
            try:
                import torch.nn.modules.module as module_module

                hook = probe._forward_hook
                hooks = module_module._global_forward_hooks
                if hook is not None and hook.id in hooks:
                    keys = list(hooks)
                    after = keys[keys.index(hook.id) + 1 :]
                    hidden.append((hooks, hook.id, hooks.pop(hook.id), after))
            except Exception as exc:  # noqa: BLE001 - never into dynamo
                probe.failed(exc)

        def end(_args: Any) -> None:
            while hidden:
                hooks, key, fn, after = hidden.pop()
                if probe._forward_hook is not None and probe._forward_hook.id == key:
                    hooks[key] = fn
                    for other in after:  # back where it was, before the hooks registered after it
                        if other in hooks:
                            hooks.move_to_end(other)

        handler.register_start_callback(start)
        handler.register_end_callback(end)
        self._compile_callbacks = (handler, start, end)

    def _unfollow_compiles(self) -> None:
        callbacks, self._compile_callbacks = self._compile_callbacks, None
        if callbacks is None:
            return
        handler, start, end = callbacks
        for remove, callback in ((handler.remove_start_callback, start), (handler.remove_end_callback, end)):
            try:
                remove(callback)
            except ValueError:  # cleared by torch._dynamo.reset()
                pass

    def _collected(self, phase: str, info: dict[str, int]) -> None:
        """``gc.callbacks``' entry while a watch is on: the collections in the watch's thread, timed."""
        if threading.get_ident() != self._thread:
            return
        if phase == "start":
            self._gc_start = thread_time()
        else:
            self.gc_cpu += thread_time() - self._gc_start

    def _remove_gc_callback(self) -> None:
        try:
            gc.callbacks.remove(self._on_gc)
        except ValueError:  # pragma: no cover - taken out by someone else
            pass

    def due(self) -> bool:
        """Whether the next backward pass will be sampled (so a step starting now is a sampled one)."""
        return perf_counter() >= self.next_due

    # -- optimizer steps -----------------------------------------------------------------
    def await_optimizer_step(self) -> None:
        """Count the next optimizer step in :attr:`optimizer_steps` (and remember its optimizer)."""
        if not self._live or self.disabled:
            return  # taken out (a failure of its own) or not installed: nothing would remove the hook
        self._armed = True
        self._unhook = False
        if self._hook is not None:
            return
        try:
            from torch.optim.optimizer import register_optimizer_step_post_hook
        except ImportError:  # pragma: no cover - torch < 2.0
            self.unavailable["optimizer_steps"] = "this torch has no global optimizer step hook"
            return
        probe = self

        def stepped(optimizer: Any, args: Any, kwargs: Any) -> None:
            try:
                if probe._armed:
                    probe._armed = False
                    probe.optimizer_steps += 1
                    probe.optimizers.add(optimizer)
                    probe._unhook = True  # not now: torch is iterating over the hooks
            except Exception as exc:  # noqa: BLE001
                probe.failed(exc)

        self._hook = register_optimizer_step_post_hook(stepped)

    def _remove_hook(self) -> None:
        self._unhook = False
        hook, self._hook = self._hook, None
        if hook is not None:
            hook.remove()

    # -- creation traces -----------------------------------------------------------------
    def trace_creations(self) -> bool:
        """Make torch record the Python stack of each graph node built from now on; False if it cannot."""
        import torch

        if self._restore is not None:
            return True
        try:
            enabled = bool(torch.is_anomaly_enabled())
            check_nan = bool(torch.is_anomaly_check_nan_enabled())
            if enabled:  # the user's own anomaly mode already records them
                return True
            torch.set_anomaly_enabled(True, False)
            self._restore = (enabled, check_nan)
        except Exception as exc:  # noqa: BLE001
            self.failed(exc)
            return False
        return True

    def stop_tracing(self) -> None:
        """Put anomaly mode back as it was before :meth:`trace_creations`."""
        restore, self._restore = self._restore, None
        if restore is None:
            return
        try:
            import torch

            torch.set_anomaly_enabled(restore[0], restore[1])
        except Exception as exc:  # noqa: BLE001
            self.failed(exc)

    @property
    def tracing(self) -> bool:
        return self._restore is not None
