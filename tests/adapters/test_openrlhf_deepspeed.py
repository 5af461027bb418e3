"""OpenRLHF gate on a real DeepSpeed ZeRO engine (one CPU rank, gloo); runs only where deepspeed is installed
(the CPU test install has no deepspeed; checked locally against deepspeed 0.19.6, ZeRO 1-3, fp32 and bf16)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("openrlhf")
pytest.importorskip("deepspeed")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("stage, dtype", [(1, "fp32"), (2, "bf16"), (3, "bf16")])
def test_real_deepspeed_zero_skip_and_rollback(tmp_path, stage, dtype):
    """OpenRLHF's DeepspeedStrategy methods on a real ZeRO engine, in a subprocess (it initialises a process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    worker = Path(__file__).with_name("openrlhf_deepspeed_worker.py")
    proc = subprocess.run([sys.executable, str(worker), str(stage), port, str(tmp_path), dtype], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # skip: DeepSpeed's own overflow path; weights, LR and moments untouched, nothing leaks into the next step
    assert (out["guard_steps"], out["guard_skipped"], out["ds_skipped"], out["micro_steps"]) == (2, 1, 1, 4)
    assert out["unchanged"] and out["lr_unchanged"] and out["overflow_reset"] and out["no_leak"]
    # rollback: strategy.load_ckpt of the healthy snapshot saved by strategy.save_ckpt, guard state inside
    assert out["rollbacks"] == 1 and out["moved"] and out["restored"] and out["client_state_has_guard"]
    assert out["tags"] == ["rl_guard_step1"]
