"""The README and the documentation site: generated pages in step with the code, snippets that run, a strict build."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from step_check_helpers import needs_transformers

from pytest_torchperf import core, registry

ROOT = Path(__file__).resolve().parent.parent
#: Pages whose complete snippets (a Python block that starts with an import) must run as written.
SNIPPET_PAGES = ("README.md", "docs/getting-started.md")


def _blocks(page: str) -> list[str]:
    text = (ROOT / page).read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```$", text, flags=re.M | re.S)
    return [b for b in blocks if b.startswith(("import ", "from "))]


SNIPPETS = [(page, i, block) for page in SNIPPET_PAGES for i, block in enumerate(_blocks(page))]


def test_the_generated_pages_are_in_step_with_the_code() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "readme_tables.py"), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_reference_has_every_invariant_argument_event_and_option() -> None:
    invariants = (ROOT / "docs" / "reference" / "invariants.md").read_text(encoding="utf-8")
    for name in registry.BUILTIN:
        assert f"## `{name}`" in invariants
        for arg in registry.get(name).arguments:
            assert f"| `{arg.name}` |" in invariants
    events = (ROOT / "docs" / "reference" / "events.md").read_text(encoding="utf-8")
    assert [line.split("`")[1] for line in events.splitlines() if line.startswith("| `")] == list(core.EVENTS)
    options = (ROOT / "docs" / "reference" / "options.md").read_text(encoding="utf-8")
    for flag in ("--torchperf-json=PATH", "--torchperf-baseline-update", "--torchperf-annotations=WHEN"):
        assert f"`{flag}`" in options
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for name in registry.BUILTIN:
        assert f"[`{name}`](docs/invariants/{name}.md)" in readme or f"| `{name}` |" in readme


def test_every_built_in_invariant_has_its_page_and_the_readme_stays_short() -> None:
    missing = [name for name in registry.BUILTIN if not (ROOT / "docs" / "invariants" / f"{name}.md").exists()]
    assert not missing, f"no docs/invariants/<name>.md for {missing}"
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 220


def test_the_snippets_are_found() -> None:
    readme = [(page, i) for page, i, _ in SNIPPETS if page == "README.md"]
    assert readme == [("README.md", 0), ("README.md", 1), ("README.md", 2)]
    assert len([s for s in SNIPPETS if s[0] != "README.md"]) >= 4


def _unique(snippets: list[tuple[str, int, str]]) -> list[tuple[str, int, str]]:
    seen: set[str] = set()
    out = []
    for page, index, code in snippets:
        if code not in seen:
            seen.add(code)
            out.append((page, index, code))
    return out


def _needs_transformers(code: str) -> bool:
    return bool(re.search(r"^(from|import) transformers\b", code, flags=re.M))


def _run_snippets(pytester: pytest.Pytester, snippets: list[tuple[str, int, str]]) -> pytest.RunResult:
    """Each snippet with a test passes (or fails with a torchperf report where it says `# fails`), in one session;
    each snippet without one runs as a script."""
    expected = {}
    for page, index, code in snippets:
        name = f"{Path(page).stem.replace('-', '_').lower()}_{index}"
        if "def test_" not in code:
            path = pytester.makepyfile(**{f"script_{name}": code})
            done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, cwd=pytester.path)
            assert done.returncode == 0, f"{page} snippet {index}: {done.stderr}"
            continue
        pytester.makepyfile(**{f"test_{name}": code})
        expected[f"test_{name}.py"] = "FAILED" if "# fails" in code else "PASSED"
    assert expected
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning", "-rA")
    outcomes = {}
    for line in result.stdout.lines:
        words = line.split()
        if len(words) >= 2 and words[0] in ("PASSED", "FAILED", "ERROR") and "::" in words[1]:
            outcomes[words[1].split("::")[0]] = words[0]
    assert outcomes == expected, result.stdout.str()[-3000:]
    return result


@pytest.mark.slow
def test_the_snippets_run_as_written(pytester: pytest.Pytester) -> None:
    """Every snippet but those of the Hugging Face Trainer (the test after this one)."""
    snippets = [s for s in _unique(SNIPPETS) if not _needs_transformers(s[2])]
    assert len(snippets) >= 4 and len([s for s in snippets if "def test_" in s[2]]) >= 3
    result = _run_snippets(pytester, snippets)
    result.stdout.fnmatch_lines(["torchperf: 1 invariant broken: no_host_sync (* syncs at test_getting_started_*.py:*"])


@pytest.mark.slow
def test_the_hugging_face_snippets_run_as_written(pytester: pytest.Pytester) -> None:
    """Where transformers is installed: the test command runs this in its side environment (see conftest)."""
    snippets = [s for s in _unique(SNIPPETS) if _needs_transformers(s[2])]
    assert [page for page, _, _ in snippets] == ["README.md"]
    needs_transformers()
    _run_snippets(pytester, snippets)


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    built = {p.relative_to(tmp_path / "site").as_posix() for p in (tmp_path / "site").rglob("index.html")}
    for name in registry.BUILTIN:
        assert f"invariants/{name}/index.html" in built
    assert {"reference/invariants/index.html", "reference/options/index.html", "cost/index.html"} <= built
    # Lists render as lists: a Markdown list with no blank line before it (after a paragraph, or after a
    # list item's continuation paragraph) is run into that paragraph, its "- " items as one block of text.
    run_together = [
        f"{page.relative_to(tmp_path / 'site').as_posix()}: {paragraph[:120]!r}"
        for page in sorted((tmp_path / "site").rglob("*.html"))
        for paragraph in re.findall(r"<p>(.*?)</p>", page.read_text(encoding="utf-8"), flags=re.S)
        if re.search(r"\n\s*(?:[-*+]|\d+\.) ", paragraph)
    ]
    assert not run_together, run_together


def test_a_list_run_into_its_paragraph_is_what_the_site_check_finds(tmp_path: Path) -> None:
    """The check above, on a page built from both spellings: only the one without the blank line is found."""
    import markdown

    html = markdown.markdown("Text:\n- a\n- b\n\nText:\n\n- c\n- d\n")
    paragraphs = re.findall(r"<p>(.*?)</p>", html, flags=re.S)
    assert [p for p in paragraphs if re.search(r"\n\s*(?:[-*+]|\d+\.) ", p)] == ["Text:\n- a\n- b"]
    assert "<li>c</li>" in html


def test_the_invariants_index_lists_every_invariant_with_its_default() -> None:
    index = (ROOT / "docs" / "invariants" / "index.md").read_text(encoding="utf-8")
    for name in registry.BUILTIN:
        invariant = registry.get(name)
        label = "on" if invariant.enabled(invariant.default) else "off"
        assert f"| [`{name}`]({name}.md) | {label} |" in index


def test_the_report_header_quoted_in_the_docs_counts_every_invariant() -> None:
    """The count a run prints (pytest_torchperf/ci.py), in the pages and the recorded figure that quote it."""
    count = f": {len(registry.BUILTIN)} invariants"
    for page in ("docs/guides/ci.md", "docs/getting-started.md", "docs/figures/data/failing-report.txt"):
        text = (ROOT / page).read_text(encoding="utf-8")
        quoted = re.findall(r"torchperf \d+\.\d+\.\d+\S*: \d+ invariants", text)
        assert quoted and all(line.endswith(count) for line in quoted), (page, quoted)


def test_new_pages_join_the_nav_without_editing_mkdocs_yml(tmp_path: Path) -> None:
    """Pages other changes add (an invariant's, a guide, a top-level page) get a place in the nav."""
    spec = importlib.util.spec_from_file_location("mkdocs_nav", ROOT / "scripts" / "mkdocs_nav.py")
    assert spec is not None and spec.loader is not None
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    docs = tmp_path / "docs"
    for page in ("index.md", "cost.md", "automatic-steps.md", "guides/ci.md", "guides/frameworks.md",
                 "invariants/index.md", "invariants/on_device.md", "invariants/no_host_sync.md",
                 "invariants/acme_new.md", "reference/options.md"):
        (docs / page).parent.mkdir(parents=True, exist_ok=True)
        (docs / page).write_text("# page\n")
    nav = [{"Home": "index.md"}, {"Invariants": ["invariants/index.md"]}, {"Guides": [{"CI": "guides/ci.md"}]},
           {"Measured cost": "cost.md"}, {"Reference": [{"Options": "reference/options.md"}]}]
    config = hook.on_config({"docs_dir": str(docs), "nav": nav})
    assert config["nav"] == [
        {"Home": "index.md"},
        {"Invariants": ["invariants/index.md", "invariants/no_host_sync.md", "invariants/on_device.md",
                        "invariants/acme_new.md"]},
        {"Guides": [{"CI": "guides/ci.md"}, "guides/frameworks.md"]},
        {"Measured cost": "cost.md"},
        "automatic-steps.md",
        {"Reference": [{"Options": "reference/options.md"}]},
    ]


def test_the_figures_are_drawn_from_their_recorded_runs() -> None:
    """The SVGs are what scripts/docs_figures.py draws from docs/figures/data, which is of the page's example."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "docs_figures.py"), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    failing = [code for page, _, code in SNIPPETS if page == "docs/getting-started.md" and "# fails" in code]
    recorded = (ROOT / "docs" / "figures" / "data" / "failing-report-test_fit.py").read_text(encoding="utf-8")
    assert failing == [recorded]
    report = (ROOT / "docs" / "figures" / "data" / "failing-report.txt").read_text(encoding="utf-8")
    assert "torchperf: 1 invariant broken: no_host_sync" in report and "test_fit.py T" in report
