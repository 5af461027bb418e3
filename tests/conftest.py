import os
import sys
from pathlib import Path

import pytest
import torch

# No network, no hub, no accidental online wandb runs during tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The models and batches in these tests are tiny: intra-op threads gain nothing and, on a shared 2-core machine,
# spin against other processes (a 4-step TRL run took 10x longer with 2 threads under load).
torch.set_num_threads(1)

# Shared test helpers (tests/file_modules.py, tests/bitwise.py) importable from every test folder.
sys.path.insert(0, str(Path(__file__).resolve().parent))


# -- honest CI: a skipped test fails unless it is marked gpu and no GPU is present -------------------------------------
# In CI (CI=true, as .ci/run sets) or with RL_GUARD_STRICT_SKIPS=1, every framework the session's nox environment
# installs (noxfile.py, docs/contributing.md) must be importable and every test must run: a skip hides a broken
# install or a test that no longer runs. The one allowed skip is a test marked ``@pytest.mark.gpu`` on a machine
# without a CUDA device; what its skip reason says does not matter.
STRICT_SKIPS = os.environ.get("CI", "").lower() == "true" or os.environ.get("RL_GUARD_STRICT_SKIPS") == "1"
GPU_MARKER = "gpu: needs a CUDA device; skipped without one (the only skip allowed under CI=true)"


def pytest_configure(config):
    config.addinivalue_line("markers", GPU_MARKER)  # also in pyproject.toml; here for suites run with this file alone


def _cuda_present() -> bool:
    return torch.cuda.is_available()  # asked at each report, not once at import


def pytest_collection_modifyitems(config, items):
    if not _cuda_present():
        for item in items:
            if item.get_closest_marker("gpu") is not None:
                item.add_marker(pytest.mark.skip(reason="marked gpu: no CUDA device here"))


def _skip_reason(longrepr) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (file, line, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _strict_message(what: str, reason: str) -> str:
    return (
        f"{what} was skipped ({reason!r}), and skips fail under CI=true / RL_GUARD_STRICT_SKIPS=1: the only "
        "allowed skip is a test marked gpu on a machine without a CUDA device. Install what the nox session "
        "installs (noxfile.py, docs/contributing.md), or fix the test."
    )


class SkippedModule(pytest.Item):
    """Stands for a test file that skipped itself at import, so that it fails as one test and the run goes on."""

    def __init__(self, *, reason: str, **kwargs):
        super().__init__(**kwargs)
        self.reason = reason

    def runtest(self):
        pytest.fail(_strict_message(f"module {self.parent.nodeid}", self.reason), pytrace=False)

    def reportinfo(self):
        return self.path, 0, f"module skipped: {self.reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    strict = STRICT_SKIPS and report.skipped and not hasattr(report, "wasxfail")
    if strict and (item.get_closest_marker("gpu") is None or _cuda_present()):
        report.outcome = "failed"
        report.longrepr = _strict_message(item.nodeid, _skip_reason(report.longrepr))


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    # A module-level pytest.importorskip / pytest.skip(allow_module_level=True) skips the whole file at collection:
    # it becomes one failing test (a collection error would stop the whole run).
    outcome = yield
    report = outcome.get_result()
    # No marker can be read from a module that did not import: every such skip fails.
    if STRICT_SKIPS and report.skipped and isinstance(collector, pytest.Module):
        reason = _skip_reason(report.longrepr)
        report.outcome, report.longrepr = "passed", None
        report.result = [SkippedModule.from_parent(collector, name="module-level-skip", reason=reason)]
