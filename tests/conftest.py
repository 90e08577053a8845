"""Shared pieces for the plugin's own tests.

Most tests run a small user suite through ``pytester``; ``user_models`` writes a
``torchperf_models.py`` beside it with a tiny dataset, LightningModule and
loader/trainer factories, so each test file only holds the test under test.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

# In-process pytester runs drop the modules a run imported when it ends; torch
# and Lightning cannot be imported twice in one process (operator registries),
# so import them once here, before any inner run.
try:
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
except ImportError:  # the torch-free compatibility runs (noxfile.py `compat-torch-free`)
    torch = None  # type: ignore[assignment]

try:
    import pytorch_lightning  # noqa: F401
except ImportError:  # pragma: no cover
    pass

#: The test modules that need no torch: without it, only these are collected.
TORCH_FREE = ("test_baseline.py", "test_github.py", "test_torch_free.py", "test_slots.py", "test_startup.py")
if torch is None:
    collect_ignore = [p.name for p in Path(__file__).parent.glob("*.py") if p.name not in TORCH_FREE + ("conftest.py",)]

# The plugin's invariants and probes are loaded by the registry when a run first
# needs them; load them once here, so in-process inner runs share them.
from pytest_torchperf import registry  # noqa: E402

registry.invariants()
if torch is not None:
    # ... and every module a watch imports as it starts and stops (the engine, its probes, the adapters):
    # an inner run that imported one of them anew would hold a second engine beside the first.
    from pytest_torchperf import watch  # noqa: E402

    with watch(scope="test"):
        pass

#: The models' dataset, also on its own: a module with torch only is what a spawned DataLoader worker
#: imports to unpickle it (the models' module imports Lightning, seconds of every worker's start-up).
DATASET = textwrap.dedent(
    '''\
    class RandomDataset(Dataset):
        def __init__(self, n=32, width=8):
            self.x = torch.randn(n, width)
            self.y = torch.randn(n, 1)

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return self.x[i], self.y[i]
    '''
)
MODELS = (
    textwrap.dedent(
        '''
        import torch
        from torch.utils.data import DataLoader, Dataset

        try:
            import pytorch_lightning as pl
        except ImportError:  # pragma: no cover - the lightning package only
            import lightning.pytorch as pl


    '''
    )
    + DATASET
    + "\n\n"
    + textwrap.dedent(
        '''\
        def make_loader(num_workers=2, persistent_workers=True, n=32, batch_size=8, **kwargs):
            if num_workers == 0:
                persistent_workers = False
            return DataLoader(
                RandomDataset(n),
                batch_size=batch_size,
                num_workers=num_workers,
                persistent_workers=persistent_workers,
                **kwargs,
            )


        class TinyModule(pl.LightningModule):
            def __init__(self, width=8):
                super().__init__()
                self.layer = torch.nn.Linear(width, 1)

            def training_step(self, batch, batch_idx):
                x, y = batch
                loss = torch.nn.functional.mse_loss(self.layer(x), y)
                self.log("train_loss", loss, prog_bar=True)
                return loss

            def validation_step(self, batch, batch_idx):
                x, y = batch
                self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.01)


        def make_trainer(tmp_path, max_epochs=3, **kwargs):
            kwargs.setdefault("num_sanity_val_steps", 1)
            return pl.Trainer(
                max_epochs=max_epochs,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                default_root_dir=str(tmp_path),
                **kwargs,
            )
        '''
    )
)


@pytest.fixture
def user_models(pytester: pytest.Pytester) -> pytest.Pytester:
    """A pytester directory holding ``torchperf_models.py`` (see ``MODELS``)."""
    pytester.makepyfile(torchperf_models=MODELS)
    pytester.syspathinsert()
    return pytester


@pytest.fixture
def group(tmp_path: Path) -> Iterator[None]:
    """A one-process gloo process group (rank 0 of 1, a file store), destroyed after the test."""
    import torch.distributed as dist  # here: the torch-free runs load this file too

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'store'}")
    try:
        yield
    finally:
        dist.destroy_process_group()


def _global_hooks() -> dict[str, list[int]]:
    """What torch's process-wide hook registries and the garbage collector's callbacks hold now."""
    import gc

    held = {"gc.callbacks": [id(fn) for fn in gc.callbacks]}
    if torch is None:
        return held
    import torch.nn.modules.module as module
    import torch.optim.optimizer as optimizer

    for owner in (module, optimizer):
        for name, registry_ in vars(owner).items():
            if name.startswith("_global_") and name.endswith("hooks") and isinstance(registry_, dict):
                held[f"{owner.__name__}.{name}"] = list(registry_)
    return held


@pytest.fixture(autouse=True)
def _no_global_hook_left() -> Iterator[None]:
    """Every test leaves torch's global hooks as it found them: a watch's hooks go with it, on every path."""
    before = _global_hooks()
    yield
    after = _global_hooks()
    left = {name: len(after[name]) - len(before.get(name, ())) for name in after if after[name] != before.get(name)}
    assert not left, f"global hooks left registered after the test: {left}"
