"""Runs a snippet in a fresh interpreter, for calls that could take the interpreter down (an
abort on allocation failure, a crash): a regression then fails one test instead of killing
pytest."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

# What a subprocess prints for a call: "OK", "<ExceptionClass>: message", or "BASE <class>" for
# an exception that is not an ``Exception`` (what the callers guard against).
_PRELUDE = """
import numpy as np, icecache
from icecache import DCIIndex, HeadForest, ResidentPages, gather_pages

def attempt(f):
    try:
        out = f()
    except Exception as e:
        print(type(e).__name__ + ": " + str(e).replace("\\n", " "))
        return None
    except BaseException as e:
        print("BASE " + type(e).__name__ + ": " + str(e).replace("\\n", " "))
        return None
    print("OK")
    return out
"""


def isolated(code: str, timeout: float = 300) -> list[str]:
    """Runs ``code`` (after ``_PRELUDE``) in a fresh interpreter and returns its output lines;
    fails the test if the interpreter died (abort, segfault, out of memory)."""
    # The snippet may import the tests' own helpers (``from test_runtime import ...``).
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, RUST_BACKTRACE="0", PYTHONPATH=path)
    r = subprocess.run(
        [sys.executable, "-c", _PRELUDE + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert r.returncode == 0, f"the interpreter died (exit {r.returncode}):\n{r.stderr[-3000:]}"
    return r.stdout.strip().splitlines()
