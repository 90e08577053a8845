"""GitHub workflow commands, exactly as GitHub documents them (torch-free)."""

from __future__ import annotations

import os

from pytest_torchperf.glue.baseline import Observation
from pytest_torchperf.glue.github import (
    ERROR,
    WARNING,
    annotations,
    enabled,
    escape_data,
    escape_property,
    workflow_command,
)


def test_messages_escape_percent_cr_and_lf_properties_also_colon_and_comma() -> None:
    assert escape_data("50% of 3:1, done\r\nnext") == "50%25 of 3:1, done%0D%0Anext"
    assert escape_property("a: b, 50%\n") == "a%3A b%2C 50%25%0A"
    # Escaping the escape character first: "%3A" in a message stays readable text after GitHub decodes it.
    assert escape_data("%3A") == "%253A"


def test_the_command_line_format() -> None:
    assert workflow_command("error", "msg: a, b", {"file": "dir,1/a:b.py", "line": 3, "title": "t", "col": None}) == (
        "::error file=dir%2C1/a%3Ab.py,line=3,title=t::msg: a, b"
    )
    assert workflow_command("warning", "plain") == "::warning::plain"


def test_enabled_on_github_actions_unless_turned_off() -> None:
    assert enabled("auto", {"GITHUB_ACTIONS": "true"}) is True
    assert enabled("auto", {"GITHUB_ACTIONS": "false"}) is False
    assert enabled("auto", {}) is False
    assert enabled("off", {"GITHUB_ACTIONS": "true"}) is False
    assert enabled("on", {}) is True


def _obs(user: str, line: int, title: str = "`.item()` in train: 1 per step over 4 steps") -> Observation:
    return Observation(
        "no_host_sync", "lib/model.py", "train", "x.item()", 7, "`.item()`", 4, 1.0, title, (user, line, "train")
    )


def test_one_annotation_per_invariant_and_line_an_error_wins_over_a_warning(tmp_path) -> None:
    repo = str(tmp_path)
    user = os.path.join(repo, "tests", "test_fit.py")
    found = [
        ("tests/test_fit.py::test_a", _obs(user, 12), WARNING, "known in the baseline", None),
        ("tests/test_fit.py::test_b", _obs(user, 12), ERROR, "", None),
        ("tests/test_fit.py::test_c", _obs(user, 12), ERROR, "", None),
        ("tests/test_fit.py::test_d", _obs(user, 30, "done, 100%\nnext"), WARNING, "report only", None),
    ]
    result = annotations(found, rootdir=os.path.join(repo, "tests"), workspace=repo)
    assert [a.text() for a in result] == [
        "::error file=tests/test_fit.py,line=12,title=torchperf no_host_sync::`.item()` in train: 1 per step over "
        "4 steps (at lib/model.py:7 in train) [tests: tests/test_fit.py::test_a and 2 more]",
        "::warning file=tests/test_fit.py,line=30,title=torchperf no_host_sync::done, 100%25 next (at lib/model.py:7 "
        "in train) (report only) [test: tests/test_fit.py::test_d]",
    ]


def test_paths_fall_back_to_the_rootdir_and_the_test_itself(tmp_path) -> None:
    root = str(tmp_path)
    no_user_frame = Observation("max_overhead", title="+40% over the plain loop", count=1)
    found = [
        ("test_x.py::test_x", no_user_frame, ERROR, "", (os.path.join(root, "test_x.py"), 5)),
        ("test_y.py::test_y", no_user_frame, ERROR, "", None),  # nowhere to point: left out
    ]
    (only,) = annotations(found, rootdir=root, workspace=None)
    assert only.text() == (
        "::error file=test_x.py,line=5,title=torchperf max_overhead::+40%25 over the plain loop [test: "
        "test_x.py::test_x]"
    )
