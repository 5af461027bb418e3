"""Under CI=true (or RL_GUARD_STRICT_SKIPS=1) a skipped test fails unless it is marked ``gpu`` and no CUDA device is
present, whatever its skip reason says; module-level skips (``pytest.importorskip`` of a missing framework) fail too.
Runs tests/conftest.py on a tiny suite."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()

SUITE = {
    "test_skips.py": """
import pytest
import torch

def test_runs():
    assert True

@pytest.mark.gpu
def test_gpu_only():
    assert torch.cuda.is_available()  # it runs only where a CUDA device is

@pytest.mark.skipif(True, reason="needs a CUDA GPU")
def test_says_gpu_but_is_not_marked():
    pass

@pytest.mark.skipif(True, reason="needs trl")
def test_framework_missing():
    pass

def test_skips_inside():
    pytest.skip("flaky on this machine")

@pytest.mark.xfail(reason="known bug", strict=True)
def test_known_bug():
    assert False
""",
    "test_importorskip.py": """
import pytest
pytest.importorskip("no_such_framework_installed")

def test_never_collected():
    pass
""",
}

# A gpu-marked test that skips itself where a CUDA device is present (torch made to report one, as a GPU machine does).
GPU_PRESENT = {
    "test_gpu_present.py": """
import pytest
import torch

torch.cuda.is_available = lambda: True

@pytest.mark.gpu
def test_gpu_skips_itself():
    pytest.skip("needs a CUDA GPU")
""",
}


def run_suite(tmp_path: Path, files: dict = SUITE, **env) -> subprocess.CompletedProcess:
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    child = {k: v for k, v in os.environ.items() if k not in ("CI", "RL_GUARD_STRICT_SKIPS", "PYTEST_ADDOPTS")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", str(tmp_path)],
        env={**child, **env},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )


def summary(out: str) -> str:
    return out.strip().splitlines()[-1]


def test_skips_are_skips_outside_ci(tmp_path):
    res = run_suite(tmp_path)
    assert res.returncode == 0, res.stdout
    want = "2 passed, 4 skipped, 1 xfailed" if CUDA else "1 passed, 5 skipped, 1 xfailed"
    assert want in summary(res.stdout), res.stdout


@pytest.mark.parametrize("env", [{"CI": "true"}, {"RL_GUARD_STRICT_SKIPS": "1"}])
def test_skips_fail_in_ci_unless_marked_gpu_without_a_gpu(tmp_path, env):
    res = run_suite(tmp_path, **env)
    out = res.stdout
    assert res.returncode == 1, out
    # a skipif mark skips at setup: it turns into a setup error, which fails the run as well
    want = "2 failed, 2 passed, 1 xfailed, 2 errors" if CUDA else "2 failed, 1 passed, 1 skipped, 1 xfailed, 2 errors"
    assert want in summary(out), out
    assert "ERROR test_skips.py::test_framework_missing" in out and "'needs trl'" in out
    # a reason that speaks of a GPU is not enough: only the marker lets a test skip
    assert "ERROR test_skips.py::test_says_gpu_but_is_not_marked" in out and "'needs a CUDA GPU'" in out
    assert "FAILED test_skips.py::test_skips_inside" in out and "'flaky on this machine'" in out
    assert "FAILED test_importorskip.py::module-level-skip" in out and "no_such_framework_installed" in out
    if CUDA:
        assert "PASSED test_skips.py::test_gpu_only" in out
    else:
        assert "SKIPPED [1] test_skips.py" in out and "marked gpu: no CUDA device here" in out
    assert "only allowed skip is a test marked gpu on a machine without a CUDA device" in out


def test_a_gpu_marked_skip_fails_in_ci_where_a_gpu_is_present(tmp_path):
    res = run_suite(tmp_path, GPU_PRESENT, CI="true")
    out = res.stdout
    assert res.returncode == 1, out
    assert "1 failed" in summary(out) and "skipped" not in summary(out), out
    assert "FAILED test_gpu_present.py::test_gpu_skips_itself" in out and "'needs a CUDA GPU'" in out
    # outside CI the same skip is a skip
    shutil.rmtree(tmp_path / "outside", ignore_errors=True)
    (tmp_path / "outside").mkdir()
    res = run_suite(tmp_path / "outside", GPU_PRESENT)
    assert res.returncode == 0 and "1 skipped" in summary(res.stdout), res.stdout
