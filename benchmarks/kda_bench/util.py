"""Small helpers shared by the modules: progress output and one-line exception text."""
from __future__ import annotations


def log(msg: str = "") -> None:
    """Print and flush at once (device logs are read while the run goes on)."""
    print(msg, flush=True)


def first_line(exc: BaseException, n: int = 200) -> str:
    """``Type: message``, first line only, at most ``n`` characters (for tables and notes)."""
    lines = f"{type(exc).__name__}: {exc}".strip().splitlines()
    s = lines[0] if lines else type(exc).__name__
    return s if len(s) <= n else s[: n - 3] + "..."
