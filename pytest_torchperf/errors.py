"""The error a wrong marker argument, fixture argument or option raises, and its "did you mean" hint.

Its own module, importing nothing, so the pytest glue can catch it at start-up without loading the
argument kinds (:mod:`pytest_torchperf.arguments` re-exports both).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["UsageError", "suggest"]


class UsageError(ValueError):
    """A torchperf marker, fixture or option was given an argument it does not accept."""


def suggest(word: str, choices: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, else an empty string."""
    import difflib  # only when something is misspelt

    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
