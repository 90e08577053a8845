"""Torch as it was: what a watch replaces compares equal to what it replaced (issue 45), the list of it is the
one docs/isolation.md gives, and a compiled step compiles as often watched as unwatched (issue 44)."""

from __future__ import annotations

import copy
import inspect
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pytest_torchperf import InvariantViolation, watch
from pytest_torchperf._transparent import Transparent
from pytest_torchperf.probes import _follow

pl = pytest.importorskip("pytorch_lightning")

DOC = Path(__file__).resolve().parents[1] / "docs" / "isolation.md"
OWNERS = {"torch": torch, "torch.nn.functional": F, "torch.Tensor": torch.Tensor, "torch.nn.Module": torch.nn.Module}


def _attributes() -> dict[tuple[str, str], Any]:
    found = {}
    for label, owner in OWNERS.items():
        for name in dir(owner):
            try:
                found[(label, name)] = getattr(owner, name)
            except Exception:  # noqa: BLE001 - a lazy attribute that raises on access
                continue
    return found


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(8, 4)  # a host tensor your code built: the Tensor operations are followed from here on
    mask = (torch.ones(8, 2) * 2).float()
    loss = (model(x) * mask).sum() + torch.lt(x, 0).float().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    loss.item()


def _replaced_in_a_watched_step() -> tuple[dict[tuple[str, str], Any], dict[tuple[str, str], Any], list[str]]:
    """The attributes before a watch, inside a step of it (defaults, a host tensor built), and ``dir(Tensor)``."""
    import torch._dynamo  # noqa: F401 - its import replaces torch.manual_seed: done before the snapshot

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt)  # torch's own lazy imports happen here, unwatched
    before = _attributes()
    inside: dict[tuple[str, str], Any] = {}
    tensor_dir: list[str] = []
    with watch(allowed_syncs=["test_identity.py"]) as run:
        for _ in range(2):
            with run.step():
                _step(model, opt)
                inside, tensor_dir = _attributes(), dir(torch.Tensor)
    assert run.report["no_host_sync"].status == "passed"
    return before, inside, tensor_dir


@pytest.fixture(scope="module")
def watched() -> tuple[dict[tuple[str, str], Any], dict[tuple[str, str], Any], list[str]]:
    return _replaced_in_a_watched_step()


def _replaced(watched: Any) -> dict[str, list[str]]:
    before, inside, _ = watched
    out: dict[str, list[str]] = {label: [] for label in OWNERS}
    for key, value in before.items():
        now = inside.get(key, value)
        # ``==`` too for what is rebuilt at each read (a classmethod bound anew, ``__dict__``'s proxy)
        if now is not value and not (type(now) is type(value) and now == value):
            out[key[0]].append(key[1])
    return {label: sorted(names) for label, names in out.items()}


def _documented() -> dict[str, list[str]]:
    text = DOC.read_text()
    block = text.split("<!-- replaced:start -->")[1].split("<!-- replaced:end -->")[0]
    out: dict[str, list[str]] = {}
    for line in block.strip().splitlines():
        match = re.match(r"- `([\w.]+)`[^:]*: (.*)", line)
        assert match, line
        out[match.group(1)] = re.findall(r"`(\w+)`", match.group(2))
    return out


def _follow_methods() -> list[str]:
    from pytest_torchperf.probes import _propagate

    skip = set(_propagate.METHODS) | set(_propagate.BINARY) | set(_propagate.UNARY)
    return sorted(_follow.method_names(torch.Tensor, skip))


def test_the_attributes_a_watch_replaces_are_the_ones_the_isolation_page_lists(watched: Any) -> None:
    replaced, documented = _replaced(watched), _documented()
    follow = set(_follow_methods())
    assert replaced["torch"] == sorted(documented["torch"])
    assert replaced["torch.nn.functional"] == sorted(documented["torch.nn.functional"])
    assert replaced["torch.nn.Module"] == sorted(documented["torch.nn.Module"])
    # Tensor: the named methods, and every operation :mod:`._follow` wraps (listed by rule: torch's own list)
    assert sorted(set(replaced["torch.Tensor"]) - follow) == sorted(documented["torch.Tensor"])
    assert follow <= set(replaced["torch.Tensor"])
    # far fewer than the 440 ``torch`` functions once replaced, and none of the comparisons or op-table keys
    assert len(replaced["torch"]) < 70
    for name in ("lt", "gt", "eq", "add", "mul", "relu", "tanh", "sigmoid", "matmul", "sum", "mean"):
        assert name not in replaced["torch"], name


def test_inside_a_watched_step_torch_and_functional_are_the_same_objects_or_equal_and_hashing_alike(
    watched: Any,
) -> None:
    before, inside, _ = watched
    for label in ("torch", "torch.nn.functional"):
        for name in _replaced(watched)[label]:
            was, now = before[(label, name)], inside[(label, name)]
            assert isinstance(now, Transparent), (label, name)
            assert now == was and was == now and not (now != was), (label, name)
            assert hash(now) == hash(was) and {was: 1}[now] == 1 and now in {was}, (label, name)
            assert now.__wrapped__ is was and now.__name__ == was.__name__, (label, name)
            assert now.__module__ == was.__module__ and now.__doc__ == was.__doc__, (label, name)
            assert getattr(now, "__qualname__", None) == getattr(was, "__qualname__", None), (label, name)
    # everything else of the two namespaces is the very object it was
    for (label, name), was in before.items():
        if label in ("torch", "torch.nn.functional") and name not in _replaced(watched)[label]:
            assert inside[(label, name)] is was or inside[(label, name)] == was, (label, name)


def test_dir_of_tensor_is_unchanged_inside_a_watched_step(watched: Any) -> None:
    assert watched[2] == dir(torch.Tensor)


def test_a_replaced_function_keeps_its_signature_repr_and_pickles_copies_as_itself() -> None:
    randn, lt = torch.randn, torch.lt
    table = {torch.lt: "<", torch.add: "+", torch.randn: "noise", torch.cat: "cat"}
    with watch(allowed_syncs=["test_identity.py"]) as run:
        with run.step():
            x = torch.randn(3)  # the wrapper, and a host tensor built: every lazy wrapper installed
            assert torch.randn is not randn and torch.randn == randn
            assert table[torch.randn] == "noise" and table[torch.cat] == "cat" and table[torch.lt] == "<"
            assert torch.lt is lt  # a comparison is never replaced
            assert repr(torch.randn) == repr(randn)
            assert str(inspect.signature(torch.einsum)) == str(inspect.signature(torch.einsum.__wrapped__))
            assert pickle.loads(pickle.dumps(torch.randn)) is randn  # pickled as torch's own function
            assert pickle.loads(pickle.dumps([randn, torch.einsum.__wrapped__])) == [randn, torch.einsum]
            assert copy.copy(torch.randn) is torch.randn and copy.deepcopy(torch.randn) is torch.randn
            assert torch.cat([x, x]).shape == (6,)
    assert torch.randn is randn


def test_a_replaced_function_reports_the_callers_line() -> None:
    """The holder adds no Python frame: the factory's birth is at the line that called it."""
    dev = torch.device("cpu")
    model = torch.nn.Linear(3, 1)
    with pytest.raises(InvariantViolation, match="on_device"):
        with watch() as run:
            for _ in range(3):
                with run.step():
                    noise = torch.randn(4, 3)  # BORN
                    model(noise.to(dev)).sum().backward()
    lines = Path(__file__).read_text().splitlines()
    born = next(i for i, line in enumerate(lines, 1) if line.endswith("# BORN"))
    assert run.report["on_device"].status == "failed"
    assert f"created at tests/test_identity.py:{born}" in "\n".join(run.report["on_device"].render(False))


# -- dynamo -----------------------------------------------------------------------------------------

_KEEP: list[Any] = []


def _compiles(watched: bool, kind: str) -> int:
    import torch._dynamo

    torch._dynamo.reset()
    graphs: list[Any] = []

    def backend(gm: Any, inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    @torch.compile(backend=backend)
    def step(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        if kind == "functions":
            return torch.relu(torch.tanh(x) + noise).sum()
        if kind == "wrapped":  # functions a watch replaces, called inside the compiled code
            return torch.cat([torch.exp(x) * noise, torch.randn(4)]).sum()
        return (x.tanh() + noise).relu().sin().sum()

    x = torch.randn(4)

    def body(i: int) -> None:
        if i % 2:
            _KEEP.append(torch.zeros(3))  # a host tensor kept: the registry changes from step to step
        step(x, torch.randn(4) * 2)  # host-built noise every step

    if watched:
        with watch(allowed_syncs=["test_identity.py"]) as run:
            for i in range(8):
                with run.step():
                    body(i)
    else:
        for i in range(8):
            body(i)
    _KEEP.clear()
    return len(graphs)


@pytest.mark.parametrize("kind", ["functions", "wrapped", "methods"])
def test_a_compiled_step_with_host_noise_each_step_compiles_as_often_watched_as_unwatched(kind: str) -> None:
    unwatched = _compiles(False, kind)
    assert unwatched == 1
    assert _compiles(True, kind) == unwatched


# -- Lightning's EarlyStopping ----------------------------------------------------------------------


def test_early_stopping_after_warm_up_steps_stops_at_the_same_epoch_watched_and_unwatched(tmp_path: Path) -> None:
    """``EarlyStopping.__init__`` compares ``self.monitor_op == torch.lt`` (its ``mode_dict`` captured at import)."""
    from pytorch_lightning.callbacks import EarlyStopping
    from torch.utils.data import DataLoader, TensorDataset

    class Model(pl.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, i: int) -> Any:
            x, y = batch
            return F.mse_loss(self.layer(x), y)

        def validation_step(self, batch: Any, i: int) -> None:
            # a loss that stops improving after the third epoch
            self.log("val_loss", torch.tensor(float(max(3 - self.current_epoch, 0))))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    def fit(watched: bool) -> int:
        torch.manual_seed(0)
        data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=8)
        model = Model()

        def run_fit() -> int:
            stop = EarlyStopping(monitor="val_loss", patience=2)
            trainer = pl.Trainer(
                max_epochs=10, callbacks=[stop], logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
            )
            trainer.fit(model, data, data)
            return int(trainer.current_epoch)

        if not watched:
            return run_fit()
        with watch(allowed_syncs=["test_identity.py"]) as run:
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            for _ in range(3):  # plain warm-up steps that build host tensors
                with run.step():
                    loss = F.mse_loss(model.layer(torch.randn(8, 4)), torch.randn(8, 1))
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
            return run_fit()

    unwatched = fit(False)
    assert unwatched == 6  # best at epoch 3, two epochs of patience
    assert fit(True) == unwatched


def _host_tensor_loop(run: Any) -> None:
    x = torch.randn(4, 2)  # a host tensor built by the loop's code: the followed operations are put in
    with run.step():
        (x * 2).sum()


def _scaled(self: torch.Tensor) -> torch.Tensor:  # a method a library adds to Tensor
    return self * 3


def test_a_tensor_method_added_after_a_watched_loop_is_followed_by_the_next_watch() -> None:
    """The names of the followed Tensor methods are read once per set of names Tensor's classes hold."""

    with watch() as run:
        _host_tensor_loop(run)

    torch.Tensor.scaled = _scaled  # type: ignore[attr-defined]  # a library adds a method between two tests
    try:
        with watch() as run:
            _host_tensor_loop(run)
            during = torch.Tensor.scaled  # type: ignore[attr-defined]
        assert during is not _scaled and torch.Tensor.scaled is _scaled  # type: ignore[attr-defined]
    finally:
        del torch.Tensor.scaled  # type: ignore[attr-defined]
    with watch() as run:
        _host_tensor_loop(run)
    assert not hasattr(torch.Tensor, "scaled")


def test_a_tensor_method_taken_away_and_another_added_is_not_confused_with_it() -> None:
    """One library's method gone and another's added leave as many names as before: the next watch follows the
    new one and does not look for the old one (a watch once reported its probe broken, in whichever test ran
    after the one that took its method away)."""

    def shifted(self: torch.Tensor) -> torch.Tensor:
        return self + 3

    torch.Tensor.scaled = _scaled  # type: ignore[attr-defined]
    try:
        with watch() as run:
            _host_tensor_loop(run)
    finally:
        del torch.Tensor.scaled  # type: ignore[attr-defined]
    torch.Tensor.shifted = shifted  # type: ignore[attr-defined]
    try:
        with watch() as run:
            _host_tensor_loop(run)
            during = torch.Tensor.shifted  # type: ignore[attr-defined]
        assert not run.report.internal_errors
        assert during is not shifted and torch.Tensor.shifted is shifted  # type: ignore[attr-defined]
    finally:
        del torch.Tensor.shifted  # type: ignore[attr-defined]
