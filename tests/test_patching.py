"""Reversible patches: any undo order puts every attribute and every type slot back exactly."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from pytest_torchperf import _slots
from pytest_torchperf.patching import Patcher, lift_all, relay_all


def test_two_patchers_on_one_attribute_undone_in_either_order() -> None:
    module = types.SimpleNamespace(f="original")
    first, second = Patcher(), Patcher()
    first.setattr(module, "f", "first")
    second.setattr(module, "f", "second")
    first.undo()  # out of order: the second patch stays on top
    assert module.f == "second"
    second.undo()
    assert module.f == "original"


def test_one_patcher_patching_an_attribute_twice_under_another_s_patch_takes_out_only_its_own_layers() -> None:
    from pytest_torchperf import patching

    module = types.SimpleNamespace(f="original")
    first, second = Patcher(), Patcher()
    first.setattr(module, "f", "first 1")
    second.setattr(module, "f", "second")
    first.setattr(module, "f", "first 2")
    assert module.f == "first 2"
    first.undo()  # both of its layers go, from under and over the other patcher's
    assert module.f == "second"
    second.undo()
    assert module.f == "original"
    assert not any(layers.owner is module for layers in patching._ATTRIBUTES.values())  # nothing kept


def test_an_inherited_attribute_is_deleted_again_whatever_the_order() -> None:
    class Base:
        def hook(self) -> str:
            return "base"

    class Child(Base):
        pass

    first, second = Patcher(), Patcher()
    first.wrap(Child, "hook", lambda original: lambda self: "first:" + original(self))
    second.wrap(Child, "hook", lambda original: lambda self: "second:" + original(self))
    assert Child().hook() == "second:first:base"
    first.undo()
    second.undo()
    assert "hook" not in vars(Child) and Child().hook() == "base"


def test_dunders_patched_by_two_patchers_leave_tensor_classes_as_they_were() -> None:
    class Sub(torch.Tensor):
        pass

    classes = (torch.Tensor, torch.nn.Parameter, Sub)
    tables = {cls: _slots.table_bytes(cls) for cls in classes}
    dicts = {cls: dict(vars(cls)) for cls in classes}
    getitem, add = torch.Tensor.__getitem__, torch.Tensor.__add__
    first, second = Patcher(), Patcher()
    first.wrap(torch.Tensor, "__getitem__", lambda original: lambda self, i: original(self, i))
    second.wrap(torch.Tensor, "__add__", lambda original: lambda self, o: original(self, o))  # later, lazily
    assert torch.tensor([torch.tensor(1.0), torch.tensor(2.0)]).tolist() == [1.0, 2.0]  # never a sequence
    first.undo()
    assert torch.tensor([torch.tensor(1.0), torch.tensor(2.0)]).tolist() == [1.0, 2.0]
    second.undo()
    assert {cls: _slots.table_bytes(cls) for cls in classes} == tables
    assert {cls: dict(vars(cls)) for cls in classes} == dicts
    assert torch.Tensor.__getitem__ is getitem and torch.Tensor.__add__ is add


def test_lifted_patches_come_back() -> None:
    module = types.SimpleNamespace(f="original")
    patcher = Patcher()
    patcher.setattr(module, "f", "patched")
    patcher.wrap(torch.Tensor, "__getitem__", lambda original: lambda self, i: original(self, i))
    lift_all()
    assert module.f == "original" and "__getitem__" not in vars(torch.Tensor)
    relay_all()
    assert module.f == "patched" and "__getitem__" in vars(torch.Tensor)
    assert torch.tensor([torch.tensor(1.0)]).tolist() == [1.0]
    patcher.undo()
    assert module.f == "original" and "__getitem__" not in vars(torch.Tensor)


def test_two_patchers_waiting_for_the_same_import_both_see_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two hooks pending on one module ask the finders in turn; neither recurses into the other."""
    import sys

    from pytest_torchperf.patching import Patcher

    (tmp_path / "torchperf_late_module.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[str] = []
    first, second = Patcher(), Patcher()
    try:
        first.on_import("torchperf_late_module", lambda module: seen.append(f"first {module.VALUE}"))
        second.on_import("torchperf_late_module", lambda module: seen.append(f"second {module.VALUE}"))
        import torchperf_late_module  # noqa: F401
    finally:
        second.undo()
        first.undo()
        sys.modules.pop("torchperf_late_module", None)
    assert sorted(seen) == ["first 1", "second 1"]


@pytest.mark.parametrize(
    "original",
    [
        torch.zeros, torch.Tensor.to, vars(torch._C.TensorBase)["__getitem__"], torch.nn.Module.to,
        torch.nn.functional.one_hot,
    ],
    ids=["builtin", "method-descriptor", "wrapper-descriptor", "python-function", "module-builtin"],
)
def test_wraps_copies_what_functools_wraps_copies(original: object) -> None:
    """The probes' ``wraps`` (C callables' attributes read once) gives a wrapper the very attributes
    ``functools.wraps`` would, so ``help()``, ``inspect`` and Lightning's signature reading see the same."""
    import functools
    import inspect

    from pytest_torchperf.patching import wraps

    def theirs(*args: object, **kwargs: object) -> None:
        pass

    def ours(*args: object, **kwargs: object) -> None:
        pass

    functools.wraps(original)(theirs)  # type: ignore[arg-type]
    for _ in range(2):  # the second time from what was read the first
        wraps(original)(ours)
        for name in (*functools.WRAPPER_ASSIGNMENTS, "__wrapped__"):
            assert getattr(ours, name, "<none>") == getattr(theirs, name, "<none>"), name
        assert vars(ours) == vars(theirs)
    try:
        expected = str(inspect.signature(theirs))
    except ValueError:  # a builtin without a text signature
        expected = "<none>"
    try:
        got = str(inspect.signature(ours))
    except ValueError:
        got = "<none>"
    assert got == expected


@pytest.mark.skipif(bool(_slots.supported()), reason="slot tables not supported on this interpreter")
def test_a_routed_slot_goes_to_torch_s_own_code_for_a_while_and_the_class_ends_byte_for_byte() -> None:
    """``SlotRoute`` points a patched ``Tensor.__getitem__``'s slot at torch's C function (what a DataLoader's
    fetch outside the steps does): indexing skips the patch, ``__getitem__`` called by name does not; nested
    users, a forced return (a step began), and nothing written once the patch is undone."""
    import operator

    tables = {cls: _slots.table_bytes(cls) for cls in (torch.Tensor, torch.nn.Parameter)}
    patcher = Patcher()
    seen: list[object] = []
    patcher.wrap(torch.Tensor, "__getitem__", lambda original: lambda self, i: seen.append(i) or original(self, i))
    route = _slots.SlotRoute(torch.Tensor, _slots.MP_SUBSCRIPT)
    assert route.live
    t = torch.arange(4.0)
    assert operator.getitem(t, 1) == 1 and seen == [1]  # patched
    route.unpatched()
    route.unpatched()  # a second user (another thread's fetch)
    assert operator.getitem(t, 2) == 2 and seen == [1]  # straight to torch's own code
    assert t.__getitem__(3) == 3 and seen == [1, 3]  # by name: the patch
    route.patched()
    assert operator.getitem(t, 0) == 0 and seen == [1, 3]  # one user left: still routed
    route.patched(leaving=False)  # a step began: the patch again, at once
    assert operator.getitem(t, 1) == 1 and seen == [1, 3, 1]
    route.patched()  # the last user leaves
    assert route.users == 0 and operator.getitem(t, 2) == 2 and seen == [1, 3, 1, 2]
    route.close()
    patcher.undo()
    route.unpatched()  # after the undo: writes nothing
    route.patched()
    assert {cls: _slots.table_bytes(cls) for cls in tables} == tables
    assert operator.getitem(t, 3) == 3 and len(seen) == 4 and "__getitem__" not in vars(torch.Tensor)


def test_wrappers_built_inside_reusing_are_kept_for_the_next_patcher_while_what_they_wrap_is_there() -> None:
    module = types.SimpleNamespace(f=lambda: "original")
    built = []

    def make(original: object) -> object:
        def wrapper() -> str:
            return "wrapped:" + original()  # type: ignore[operator]

        built.append(wrapper)
        return wrapper

    def install(scope: object) -> object:
        before = module.f
        patcher = Patcher()
        with patcher.reusing(scope):
            patcher.wrap(module, "f", make)
        assert module.f() == "wrapped:" + before()
        value = module.f
        patcher.undo()
        assert module.f is before
        return value

    first = install("scope")
    assert install("scope") is first and len(built) == 1  # the same wrapper, not built again
    assert install("another scope") is not first and len(built) == 2  # another scope: its own
    module.f = lambda: "replaced"  # what it wrapped is gone: built again, around the new one
    third = install("scope")
    assert third is not first and len(built) == 3
    patcher = Patcher()
    patcher.wrap(module, "f", make)  # outside ``reusing``: always built
    assert len(built) == 4 and module.f() == "wrapped:replaced"
    patcher.undo()


def test_a_patch_is_taken_back_alone_only_while_nothing_is_over_it() -> None:
    module = types.SimpleNamespace(f="original", g="g")
    first, second = Patcher(), Patcher()
    patch = first.setattr(module, "f", "first")
    first.setattr(module, "g", "first g")
    second_patch = second.setattr(module, "f", "second")
    assert not first.take_back(patch) and module.f == "second"  # another layer over it: stays
    assert second.take_back(second_patch) and module.f == "first"
    module.f = "set by hand"  # not through a patcher: the attribute no longer holds the patch
    assert not first.take_back(patch) and module.f == "set by hand"
    module.f = "first"
    assert first.take_back(patch) and module.f == "original" and module.g == "first g"
    assert not first.take_back(patch)  # once
    first.undo()  # the rest; the patch taken back is not undone twice
    assert (module.f, module.g) == ("original", "g")
    second.undo()
    assert (module.f, module.g) == ("original", "g")


def test_a_watch_sets_the_very_wrappers_of_the_last_one() -> None:
    from pytest_torchperf import watch

    seen = []
    for _ in range(2):
        with watch():
            seen.append((vars(torch.Tensor)["item"], vars(torch.Tensor)["to"], torch.randn, torch.Tensor.__getitem__))
        assert "item" not in vars(torch.Tensor) and "to" not in vars(torch.Tensor)
    assert all(a is b for a, b in zip(*seen))
