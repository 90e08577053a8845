"""The engine's guard: a probe's own error takes the probe out and never reaches the user's call."""

from __future__ import annotations

import json
from typing import Any, Callable

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from pytest_torchperf import InvariantViolation, watch
from pytest_torchperf.report import NOT_CHECKED, Report

VERSION_ERROR = "RuntimeError: Inference tensors do not track version counter."


def _train(run: Any, steps: int = 3) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(4 * steps, 4), torch.randn(4 * steps, 1))
    for x, y in DataLoader(data, batch_size=4):
        with run.step():
            torch.nn.functional.mse_loss(model(x.to("cpu")), y).backward()
            opt.step()
            opt.zero_grad()
    return model


def _watched(body: Callable[[Any], Any], **kwargs: Any) -> tuple[Any, Report]:
    try:
        with watch(**kwargs) as run:
            out = body(run)
        report = run.report
    except InvariantViolation as exc:
        report = exc.report
    assert report is not None
    return out, report


def _inference_pass(run: Any) -> list[torch.Tensor]:
    """What torchvision's reference loop does after training: evaluate under ``inference_mode``."""
    model = _train(run)
    data = TensorDataset(torch.arange(8.0).reshape(4, 2).repeat(1, 2), torch.zeros(4, 1))
    outs = []
    with torch.inference_mode():
        for x, _y in DataLoader(data, batch_size=2):
            with run.step():
                outs.append(model(x.to("cpu")))
                outs.append(torch.empty(2).fill_(3.0))
    return outs


def test_a_dataloader_iterated_in_inference_mode_after_training_runs_as_unwatched() -> None:
    class Unwatched:
        def step(self) -> Any:
            return _Nothing()

    expected = _inference_pass(Unwatched())
    outs, report = _watched(_inference_pass)
    assert all(torch.equal(a, b) for a, b in zip(outs, expected)) and len(outs) == len(expected)
    assert report.internal_errors["tensors"] == VERSION_ERROR
    assert report["on_device"].status == NOT_CHECKED
    assert report["on_device"].summary == (
        f"torchperf internal error in probe tensors: {VERSION_ERROR}; the check is not checked"
    )
    # syncs needs tensors: taken out with it, its invariant not checked with the reason
    assert report.internal_errors["syncs"] == "taken out with probe tensors, which it needs"
    assert report["no_host_sync"].status == NOT_CHECKED


def test_the_user_s_own_error_from_a_watched_call_goes_up_untouched() -> None:
    def body(run: Any) -> None:
        with run.step():
            torch.zeros(2).item()

    with pytest.raises(RuntimeError, match="a Tensor with 2 elements cannot be converted to Scalar"):
        _watched(body)


def test_the_user_s_error_inside_an_inference_mode_move_goes_up_and_the_probe_stays() -> None:
    def body(run: Any) -> None:
        with torch.inference_mode(), run.step():
            torch.zeros(2).to("no-such-device")

    with watch() as run:
        with pytest.raises(RuntimeError, match="no-such-device"):
            body(run)
    assert run.report is not None and "tensors" not in run.report.internal_errors


@pytest.mark.parametrize(
    "context",
    [
        pytest.param(torch.no_grad, id="no_grad"),
        pytest.param(torch.inference_mode, id="inference_mode"),
        pytest.param(torch.enable_grad, id="enable_grad"),
    ],
)
def test_grad_modes_give_the_same_values_watched_as_unwatched(context: Callable[[], Any]) -> None:
    def body(run: Any) -> list[Any]:
        torch.manual_seed(0)
        with context():
            a = torch.ones(3).to("cpu")
            b = torch.empty(3).fill_(2.0)
            with run.step():
                c = (a + b).to("cpu")
                d = torch.zeros(2).normal_()
                value = float(c.sum())
        return [a, b, c, d.shape, value]

    expected = body(_Unwatched())
    got, report = _watched(body)
    assert [x.tolist() if isinstance(x, torch.Tensor) else x for x in got] == [
        x.tolist() if isinstance(x, torch.Tensor) else x for x in expected
    ]
    errors = set(report.internal_errors) - {"syncs"}
    assert errors <= {"tensors"}
    for name in report.internal_errors:
        assert name in {"tensors", "syncs"}


def test_meta_tensors_and_a_tensor_subclass_behave_as_unwatched() -> None:
    class Tagged(torch.Tensor):
        pass

    def body(run: Any) -> list[Any]:
        with run.step():
            meta = torch.empty(3, device="meta").to("meta")
            meta.fill_(1.0)
            tagged = torch.ones(2).as_subclass(Tagged).to("cpu")
            kept = type(tagged)
            total = tagged.sum().item()
        return [meta.shape, meta.device.type, kept, total]

    expected = body(_Unwatched())
    got, report = _watched(body, no_host_sync=True, on_device=True)
    assert got == expected
    assert not report.internal_errors


def test_fake_tensors_behave_as_unwatched() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    def body(run: Any) -> list[Any]:
        with FakeTensorMode(), run.step():
            x = torch.ones(4).to("cpu")
            y = torch.empty(4).fill_(2.0)
            z = (x * y).sum()
        return [type(z).__name__, tuple(z.shape), x.device.type]

    expected = body(_Unwatched())
    got, report = _watched(body, no_host_sync=True, on_device=True)
    assert got == expected
    assert set(report.internal_errors) <= {"tensors", "syncs"}


def test_an_inference_mode_loop_under_the_marker_passes_and_the_json_lists_the_internal_error(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        """
        import pytest
        import torch
        from torch.utils.data import DataLoader, TensorDataset

        @pytest.mark.torchperf
        def test_train_then_evaluate():
            model = torch.nn.Linear(4, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
            for x, y in DataLoader(data, batch_size=4):
                torch.nn.functional.mse_loss(model(x.to("cpu")), y).backward()
                opt.step()
                opt.zero_grad()
            with torch.inference_mode():
                for x, y in DataLoader(data, batch_size=4):
                    model(x.to("cpu"))
        """
    )
    result = pytester.runpytest_subprocess("--torchperf-json=out.json")
    result.assert_outcomes(passed=1)
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    doc = json.loads((pytester.path / "out.json").read_text())
    (run,) = doc["tests"][0]["runs"]
    assert run["internal_errors"]["tensors"] == VERSION_ERROR
    assert doc["tests"][0]["checks"]["on_device"]["status"] == NOT_CHECKED


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


class _Unwatched:
    def step(self) -> _Nothing:
        return _Nothing()


# -- the guard itself, through a probe's patcher ------------------------------------------------------------


class _Probe:
    """What the engine gives a probe's patcher: its failure handler (the errors it was handed)."""

    def __init__(self) -> None:
        self.errors: list[BaseException] = []

    def failed(self, exc: BaseException) -> None:
        self.errors.append(exc)


class _Counter:
    """An owner with a side-effecting method: every real call counted."""

    def __init__(self) -> None:
        self.calls = 0

    def bump(self, by: int = 1) -> int:
        self.calls += by
        return self.calls


def _patched(owner: Any, name: str, make: Callable[[Any], Any]) -> tuple[Any, _Probe]:
    from pytest_torchperf.patching import Patcher

    probe = _Probe()
    patcher = Patcher(contain=probe.failed)
    patcher.wrap(owner, name, make)
    return patcher, probe


def test_a_probe_error_after_the_original_ran_returns_its_result_without_calling_it_again() -> None:
    def make(original: Any) -> Any:
        def bump(self: Any, by: int = 1) -> int:
            out = original(self, by)
            raise ValueError("bookkeeping broke")
            return out  # pragma: no cover

        return bump

    patcher, probe = _patched(_Counter, "bump", make)
    try:
        counter = _Counter()
        assert counter.bump(5) == 5
        assert counter.calls == 5  # the original ran once
    finally:
        patcher.undo()
    assert [str(e) for e in probe.errors] == ["bookkeeping broke"]


def test_a_probe_error_before_the_original_ran_calls_it_once() -> None:
    def make(original: Any) -> Any:
        def bump(self: Any, by: int = 1) -> int:
            raise KeyError("before")

        return bump

    patcher, probe = _patched(_Counter, "bump", make)
    try:
        counter = _Counter()
        assert counter.bump(3) == 3
        assert counter.calls == 3
    finally:
        patcher.undo()
    assert [type(e) for e in probe.errors] == [KeyError]


def _boom(raised: list[BaseException]) -> None:
    exc = ZeroDivisionError("the user's own error")
    raised.append(exc)
    raise exc


def _visible(exc: BaseException) -> list[tuple[str, str]]:
    """The traceback pytest shows for ``exc``: (function, source line) of every frame it does not hide."""
    info = pytest.ExceptionInfo.from_exception(exc)
    return [(entry.name, str(entry.statement).strip()) for entry in info.traceback.filter(info)]


def _call_boom(owner: Any, raised: list[BaseException]) -> BaseException:
    try:
        owner.boom(raised)
    except ZeroDivisionError as exc:
        return exc
    raise AssertionError("no error")  # pragma: no cover


@pytest.mark.parametrize("after", [False, True], ids=["bookkeeping-ok", "bookkeeping-fails-after"])
def test_the_user_s_error_is_the_same_object_with_the_same_traceback(after: bool) -> None:
    import types

    owner = types.SimpleNamespace(boom=_boom)
    raised: list[BaseException] = []
    unwatched = _visible(_call_boom(owner, raised))

    def make(original: Any) -> Any:
        def boom(raised: list[BaseException]) -> None:
            __tracebackhide__ = True
            try:
                original(raised)
            finally:
                if after:
                    raise RuntimeError("the probe's own error while the user's went up")

        return boom

    patcher, probe = _patched(owner, "boom", make)
    try:
        got = _call_boom(owner, raised)
    finally:
        patcher.undo()
    assert got is raised[-1]
    assert _visible(got) == unwatched
    assert got.__context__ is None  # the probe's error is not chained onto the user's
    assert [type(e) for e in probe.errors] == ([RuntimeError] if after else [])


def test_stop_iteration_from_the_original_ends_the_loop_and_is_not_a_probe_error() -> None:
    class Numbers:
        def __init__(self) -> None:
            self.left = 3

        def __iter__(self) -> Any:
            return self

        def __next__(self) -> int:
            if not self.left:
                raise StopIteration
            self.left -= 1
            return self.left

    def make(original: Any) -> Any:
        def __next__(self: Any) -> int:
            return original(self)

        return __next__

    patcher, probe = _patched(Numbers, "__next__", make)
    try:
        assert list(Numbers()) == [2, 1, 0]
    finally:
        patcher.undo()
    assert probe.errors == []


def test_nested_and_recursive_wrapped_calls_each_finish_with_their_own_result() -> None:
    class Tree:
        def __init__(self) -> None:
            self.visits = 0
            self.leaves = 0

        def visit(self, depth: int) -> int:
            self.visits += 1
            return self.leaf(depth) if depth == 0 else 10 * self.visit(depth - 1) + depth

        def leaf(self, depth: int) -> int:
            self.leaves += 1
            return 7

    def failing_after(original: Any) -> Any:
        def wrapper(self: Any, depth: int) -> int:
            out = original(self, depth)
            raise OSError(f"after {original.__name__} at depth {depth}")
            return out  # pragma: no cover

        return wrapper

    def failing_before_on_odd(original: Any) -> Any:
        def wrapper(self: Any, depth: int) -> int:
            if depth % 2:
                raise OSError(f"before visit at depth {depth}")
            return original(self, depth)

        return wrapper

    unwatched = Tree().visit(3)
    leaf_patcher, leaf_probe = _patched(Tree, "leaf", failing_after)
    visit_patcher, visit_probe = _patched(Tree, "visit", failing_before_on_odd)
    try:
        tree = Tree()
        assert tree.visit(3) == unwatched
        assert (tree.visits, tree.leaves) == (4, 1)
    finally:
        visit_patcher.undo()
        leaf_patcher.undo()
    assert [str(e) for e in leaf_probe.errors] == ["after leaf at depth 0"]
    assert [str(e) for e in visit_probe.errors] == ["before visit at depth 3", "before visit at depth 1"]


def test_threads_each_keep_their_own_call_record() -> None:
    import threading

    barrier = threading.Barrier(2)

    class Worker:
        def work(self, n: int) -> int:
            barrier.wait(timeout=10)  # both threads inside their original at once
            return n * n

    def make(original: Any) -> Any:
        def work(self: Any, n: int) -> int:
            out = original(self, n)
            if n == 3:
                raise LookupError("the probe fails in one thread only")
            return out

        return work

    patcher, probe = _patched(Worker, "work", make)
    results: dict[int, int] = {}
    try:
        threads = [threading.Thread(target=lambda n=n: results.__setitem__(n, Worker().work(n))) for n in (3, 4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=20)
    finally:
        patcher.undo()
    assert results == {3: 9, 4: 16}
    assert [type(e) for e in probe.errors] == [LookupError]


def test_a_wrapper_shows_the_original_it_wraps_and_reads_its_caller_s_frame() -> None:
    import inspect
    import sys

    from pytest_torchperf._guard import caller_frame
    from pytest_torchperf.patching import wraps

    seen: list[Any] = []

    def make(original: Any) -> Any:
        @wraps(original)
        def bump(self: Any, by: int = 1) -> int:
            seen.append(caller_frame())
            return original(self, by)

        return bump

    patcher, _probe = _patched(_Counter, "bump", make)
    try:
        _Counter().bump(2)
        here = sys._getframe()
        assert seen == [here]
        assert _Counter.bump.__wrapped__ is vars(_Counter)["bump"].__wrapped__
        assert inspect.signature(_Counter.bump) == inspect.signature(_Counter.bump.__wrapped__)
        assert _Counter.bump.__wrapped__.__qualname__ == "_Counter.bump"
    finally:
        patcher.undo()


def test_a_tensor_subclass_is_handed_torch_s_own_function_and_its_error_is_the_user_s() -> None:
    seen: list[Any] = []
    to = torch.Tensor.to  # keyed on torch's own method, as a subclass's table built at import is

    class Strict(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            seen.append(func)
            if func is to and args[1:] == ("nowhere",):
                raise ValueError("Strict tensors stay put")
            return super().__torch_function__(func, types, args, kwargs or {})

    def body(run: Any) -> Any:
        with run.step():
            x = torch.ones(2).as_subclass(Strict)
            moved = x.to("cpu")
            with pytest.raises(ValueError, match="stay put"):
                x.to("nowhere")
        return type(moved)

    seen.clear()
    expected = body(_Unwatched())
    unwatched_funcs = list(seen)
    seen.clear()
    got, report = _watched(body, on_device=True)
    assert got is expected is Strict
    assert to in seen and seen.count(to) == unwatched_funcs.count(to)
    assert "tensors" not in report.internal_errors
