"""Under CI=true (or RL_GUARD_STRICT_SKIPS=1) a skipped test fails unless it skipped for want of a GPU; module-level
skips (``pytest.importorskip`` of a missing framework) fail too. Runs tests/conftest.py on a tiny suite."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SUITE = {
    "test_skips.py": '''
import pytest

def test_runs():
    assert True

@pytest.mark.skipif(True, reason="needs a CUDA GPU")
def test_gpu_only():
    pass

@pytest.mark.skipif(True, reason="needs trl")
def test_framework_missing():
    pass

def test_skips_inside():
    pytest.skip("flaky on this machine")

@pytest.mark.xfail(reason="known bug", strict=True)
def test_known_bug():
    assert False
''',
    "test_importorskip.py": '''
import pytest
pytest.importorskip("no_such_framework_installed")

def test_never_collected():
    pass
''',
}


def run_suite(tmp_path: Path, **env) -> subprocess.CompletedProcess:
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    for name, text in SUITE.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    child = {k: v for k, v in os.environ.items() if k not in ("CI", "RL_GUARD_STRICT_SKIPS", "PYTEST_ADDOPTS")}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", str(tmp_path)],
                          env={**child, **env}, cwd=tmp_path, capture_output=True, text=True, timeout=120)


def summary(out: str) -> str:
    return out.strip().splitlines()[-1]


def test_skips_are_skips_outside_ci(tmp_path):
    res = run_suite(tmp_path)
    assert res.returncode == 0, res.stdout
    assert "1 passed, 4 skipped, 1 xfailed" in summary(res.stdout), res.stdout


@pytest.mark.parametrize("env", [{"CI": "true"}, {"RL_GUARD_STRICT_SKIPS": "1"}])
def test_skips_fail_in_ci_unless_for_a_gpu(tmp_path, env):
    res = run_suite(tmp_path, **env)
    out = res.stdout
    assert res.returncode == 1, out
    # a skipif mark skips at setup: it turns into a setup error, which fails the run as well
    assert "2 failed, 1 passed, 1 skipped, 1 xfailed, 1 error" in summary(out), out
    assert "ERROR test_skips.py::test_framework_missing" in out and "'needs trl'" in out
    assert "FAILED test_skips.py::test_skips_inside" in out and "'flaky on this machine'" in out
    assert "FAILED test_importorskip.py::module-level-skip" in out and "no_such_framework_installed" in out
    assert "SKIPPED [1] test_skips.py" in out and "needs a CUDA GPU" in out
    assert "only allowed skip reason is a missing GPU/CUDA" in out
