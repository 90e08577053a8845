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
