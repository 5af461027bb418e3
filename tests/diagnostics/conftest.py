import math

import pytest

from rl_guard import glossary
from rl_guard.diagnostics import RunDiagnostics, SampleBatch


def check_names(metrics: dict) -> None:
    """Every emitted metric is finite and documented (so a YAML rule may name it)."""
    for name, value in metrics.items():
        assert math.isfinite(value), (name, value)
        assert glossary.is_known(name), name


@pytest.fixture
def check():
    return check_names


@pytest.fixture
def diag():
    """diag(step=0, diagnostics=None, **SampleBatch fields) -> metrics without the rl_guard/ prefix."""

    def run(step=0, diagnostics=None, optimizer_updates=None, **fields):
        d = diagnostics or RunDiagnostics()
        metrics = d.update(SampleBatch(**fields), step, optimizer_updates=optimizer_updates)
        check_names(metrics)
        return {k.removeprefix("rl_guard/"): v for k, v in metrics.items()}

    return run
