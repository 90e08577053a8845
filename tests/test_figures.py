"""Each invariant's figures as a declared type: refused at registration when they clash, one schema from them."""

from __future__ import annotations

from typing import Any, Optional, TypedDict

import pytest

from pytest_torchperf import figures, registry
from pytest_torchperf.arguments import UsageError
from pytest_torchperf.registry import Invariant, register, unregister


class _Nothing:
    def __init__(self, run: Any) -> None:
        self.run = run


class Clashing(TypedDict, total=False):
    steps: int
    status: str  # the verdict's own field in the JSON and the JUnit properties


class Fine(TypedDict, total=False):
    steps: int
    ranks: int  # a figure may count ranks: the per-process merge is in its own field
    worst: Optional[float]
    sites: list[dict[str, Any]]


def test_every_built_in_invariant_declares_its_figures_and_none_is_a_verdict_field() -> None:
    for name in registry.BUILTIN:
        declared = figures.names(registry.get(name).figures)
        assert declared, f"{name} declares no figures"
        assert not set(declared) & figures.RESERVED, name


def test_a_figure_named_like_a_verdict_field_is_refused_at_registration_with_the_name() -> None:
    with pytest.raises(UsageError, match=r"declares the figure 'status', a name its verdict already uses"):
        register(Invariant(name="clashing_figures", doc="", check=_Nothing, figures=Clashing))
    assert "clashing_figures" not in registry.invariants()


def test_figures_that_are_no_typed_dict_are_refused_at_registration() -> None:
    with pytest.raises(UsageError, match=r"figures of invariant 'untyped_figures' must be a TypedDict"):
        register(Invariant(name="untyped_figures", doc="", check=_Nothing, figures=dict))


def test_the_figures_schema_is_generated_from_the_declared_types() -> None:
    register(Invariant(name="fine_figures", doc="", check=_Nothing, figures=Fine))
    try:
        schema = figures.schema(registry.get("fine_figures").figures)
    finally:
        unregister("fine_figures")
    assert schema == {
        "type": "object",
        "properties": {
            "steps": {"type": "integer"},
            "ranks": {"type": "integer"},
            "worst": {"type": ["number", "null"]},
            "sites": {"type": "array", "items": {"type": "object"}},
        },
        "additionalProperties": False,
    }
    assert figures.type_text(figures.declared(Fine)["worst"]) == "float | None"


def test_the_baseline_compares_a_figure_the_counting_invariants_declare() -> None:
    from pytest_torchperf.glue.baseline import COUNTED_FIGURE

    for name in ("max_ops_per_step", "max_collectives_per_step"):
        assert COUNTED_FIGURE in figures.names(registry.get(name).figures)
