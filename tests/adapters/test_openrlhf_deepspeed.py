"""OpenRLHF gate on a real DeepSpeed ZeRO engine (one CPU rank, gloo): ZeRO-1 fp32, ZeRO-2 and ZeRO-3 bf16.

The test command installs deepspeed 0.19.6 (``DS_BUILD_OPS=0``; torch's Adam, so no native optimizer op)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rank_launch import free_port

pytest.importorskip("openrlhf")
pytestmark = pytest.mark.slow  # one process importing deepspeed, three engines: about 40 s
ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ("1:fp32", "2:bf16", "3:bf16")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """OpenRLHF's DeepspeedStrategy methods on real ZeRO engines, in a subprocess (it initialises a process group)."""
    port = str(free_port())
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
    }
    worker = Path(__file__).with_name("openrlhf_deepspeed_worker.py")
    proc = subprocess.run(
        [sys.executable, str(worker), ",".join(CONFIGS), port, str(tmp_path_factory.mktemp("ds"))],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("config", CONFIGS)
def test_real_deepspeed_zero_skip_and_rollback(results, config):
    out = results[config]
    # the guard probes the ZeRO gradient partitions: its norm is DeepSpeed's own global norm
    assert out["grad_norm"] == pytest.approx(out["ds_grad_norm"], rel=1e-6)
    # skip: DeepSpeed's own overflow path; weights, LR and moments untouched, nothing leaks into the next step
    assert (out["guard_steps"], out["guard_skipped"], out["ds_skipped"], out["micro_steps"]) == (2, 1, 1, 4)
    assert out["unchanged"] and out["lr_unchanged"] and out["overflow_reset"] and out["no_leak"]
    # rollback: strategy.load_ckpt of the healthy snapshot saved by strategy.save_ckpt, guard state inside
    assert out["rollbacks"] == 1 and out["moved"] and out["restored"] and out["client_state_has_guard"]
    assert out["tags"] == ["rl_guard_step0", "rl_guard_step1"]  # the starting state and the healthy snapshot


@pytest.mark.parametrize("config", CONFIGS)
def test_a_skip_deepspeed_does_not_take_is_noticed_and_halts(results, config):
    """The overflow path disabled: DeepSpeed applies the update the guard dropped; the guard sees that
    ``skipped_steps`` did not advance, records ``skip_not_taken``, checkpoints and halts."""
    out = results[config]
    assert out["no_overflow_applied"] and out["no_overflow_ds_skipped"] == 0
    assert "DeepSpeed applied the update of step 1 that the guard dropped" in out["no_overflow_halted"]
    assert (out["no_overflow_rule"], out["no_overflow_decision"]) == ("skip_not_taken", "checkpoint_and_halt")
    assert out["no_overflow_escalated_from"] == "skip_step" and out["no_overflow_checkpoint"]


@pytest.mark.parametrize("config", CONFIGS)
def test_a_zero_optimizer_without_check_overflow_is_refused_at_attach(results, config):
    error = results[config]["renamed_error"]
    assert "has no overflow / check_overflow" in error and "deepspeed >= 0.19.6, < 0.19.7" in error
