"""Shared pytest configuration for cula.

* ``@pytest.mark.gpu_sm90``: tests that need an SM90 (Hopper) CUDA GPU *and* the compiled
  extension ``cula._C``. They are skipped, with the reason shown by ``pytest -rs``, where either is
  missing.
* ``seed`` fixture: a fresh random seed per test (from ``os.urandom``), applied to torch and
  printed, so a failure shows how to reproduce it. Set ``CULA_TEST_SEED=<n>`` to replay a seed.
* ``summary_lines`` fixture: a list that tests append lines to; pytest prints them in its terminal
  summary (output written from a fixture's teardown is captured and lost, so summaries such as
  the GPU tests' error table go through here).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch


@functools.lru_cache(maxsize=None)
def sm90_unavailable_reason() -> str:
    """"" when an SM90 GPU and the compiled extension are both present, else why not."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    cap = torch.cuda.get_device_capability(0)
    if cap != (9, 0):
        name = torch.cuda.get_device_name(0)
        return f"needs an SM90 (Hopper) GPU, found {name} with capability {cap[0]}.{cap[1]}"
    from cula._ext import kernels_available, kernels_unavailable_reason

    if not kernels_available():
        return f"needs the compiled extension: {kernels_unavailable_reason()}"
    return ""


_SUMMARY_LINES = pytest.StashKey[list]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_SUMMARY_LINES] = []
    config.addinivalue_line(
        "markers",
        "gpu_sm90: needs an SM90 (Hopper) CUDA GPU and the compiled cula._C extension "
        "(skipped with the reason otherwise)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = sm90_unavailable_reason()
    if not reason:
        return
    skip = pytest.mark.skip(reason=f"gpu_sm90: {reason}")
    for item in items:
        if "gpu_sm90" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """A fresh seed per test, applied with torch.manual_seed (CPU and CUDA) and printed."""
    env = os.environ.get("CULA_TEST_SEED")
    value = int(env) if env else int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(value)
    print(f"[seed] {request.node.nodeid}: CULA_TEST_SEED={value}")
    return value


@pytest.fixture(scope="session")
def summary_lines(pytestconfig: pytest.Config) -> list:
    """Lines for the end of the run: pytest prints them in its terminal summary."""
    return pytestconfig.stash[_SUMMARY_LINES]


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    lines = config.stash.get(_SUMMARY_LINES, [])
    if lines:
        terminalreporter.section("cula summary")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture
def count_calls(monkeypatch: pytest.MonkeyPatch):
    """``count_calls(module, name)`` wraps ``module.name`` for the test and returns a list that
    grows by one entry per call (the tests that check how often a rule runs)."""

    def wrap(module, name: str) -> list[int]:
        runs: list[int] = []
        real = getattr(module, name)

        def counting(*args, **kwargs):
            runs.append(1)
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counting)
        return runs

    return wrap
