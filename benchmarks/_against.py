"""Run a benchmark against another checkout of pytest-torchperf, interleaved in one run.

Two packages named ``pytest_torchperf`` cannot live in one process, so each
checkout gets a worker process (the same benchmark script with ``--worker``,
the checkout first on ``sys.path``). The parent asks the workers for one round
each, in an order that alternates every round, so a drift of the machine hits
both alike; each worker measures its own variants (unwatched and watched, A/A)
within its round, so every ratio is taken inside one process.

Protocol: the parent writes ``round\\n``, the worker answers one JSON line;
``stop\\n`` ends it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any, Callable


def checkout_env(root: str | None, **extra: str) -> dict[str, str]:
    """This process's environment for a process that imports the package from checkout ``root`` (None: this one)."""
    env = dict(os.environ, **extra)
    if root:
        env["PYTHONPATH"] = os.path.abspath(root) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def serve(one_round: Callable[[], Any]) -> None:
    """The worker's loop: one round per request, answered as one JSON line on stdout."""
    out = sys.stdout
    sys.stdout = sys.stderr  # whatever the benchmark prints must not break the protocol
    for line in sys.stdin:
        if line.strip() != "round":
            break
        out.write(json.dumps(one_round()) + "\n")
        out.flush()


class Workers:
    """One worker per checkout (``labels[i]`` -> ``roots[i]``; a root of None: the checkout the script is in)."""

    def __init__(self, script: str, args: list[str], roots: dict[str, str | None]) -> None:
        self.procs: dict[str, subprocess.Popen] = {}
        for label, root in roots.items():
            self.procs[label] = subprocess.Popen(
                [sys.executable, script, "--worker", *args],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=checkout_env(root),
                cwd=os.path.abspath(root) if root else None,
            )

    def rounds(self, n: int) -> Iterator[dict[str, Any]]:
        """``n`` rounds: each yields ``{label: that worker's figures}``, the workers' order alternating."""
        labels = list(self.procs)
        for r in range(n):
            order = labels if r % 2 == 0 else labels[::-1]
            out: dict[str, Any] = {}
            for label in order:
                proc = self.procs[label]
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write("round\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"the {label} worker ended (see its stderr above)")
                out[label] = json.loads(line)
            yield out

    def close(self) -> None:
        for proc in self.procs.values():
            try:
                if proc.stdin is not None:
                    proc.stdin.write("stop\n")
                    proc.stdin.close()
                proc.wait(timeout=30)
            except Exception:  # noqa: BLE001 - a worker that does not stop is ended
                proc.kill()
                proc.wait()
