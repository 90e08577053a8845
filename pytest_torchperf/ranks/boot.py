"""``python -m pytest_torchperf.ranks.boot <script> [args]`` (or ``-m <module> [args]``): run a rank under watch.

torchrun's agent, called inside a watched test, starts each rank with this in
front of the script (see :mod:`pytest_torchperf.ranks.launches`). It reads the
launching runs from :data:`~pytest_torchperf.ranks.child.ENV`, starts them,
runs the script as ``python <script>`` would (``__main__``, ``sys.argv``,
``sys.path[0]``), reports, and exits as the script did.
"""

from __future__ import annotations

import os
import runpy
import sys

from .child import ChildRuns, RankSpec, context


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m pytest_torchperf.ranks.boot <script> [args] | -m <module> [args]")
    ctx = context()
    local = os.environ.get("LOCAL_RANK", "0")
    spec = RankSpec(ctx["dir"], ctx.get("launcher", "torchrun"), list(ctx.get("runs", []))) if ctx else None
    if argv[0] == "-m":
        sys.argv = argv[1:]
        run = lambda: runpy.run_module(argv[1], run_name="__main__", alter_sys=True)  # noqa: E731
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        run = lambda: runpy.run_path(argv[0], run_name="__main__")  # noqa: E731
    if spec is None:  # started by hand: just run it
        run()
        return
    with ChildRuns(spec, int(local) if local.isdigit() else 0):
        run()


if __name__ == "__main__":
    main(sys.argv[1:])
