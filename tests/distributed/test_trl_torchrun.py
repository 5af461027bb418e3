"""The TRL callback under a real ``torchrun --nproc_per_node 2`` CPU launch (accelerate picks gloo).

Rank 1 alone gets an inf gradient entry after backward (after DDP's all-reduce); both ranks must halt at the same
optimizer step with finite, identical weights and one checkpoint file each.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from file_modules import load_module
from rank_launch import run_torchrun

_launch = load_module("distributed_launch", Path(__file__).with_name("conftest.py"))  # the multi-process tests' env
HERE, REPO, child_env = _launch.HERE, _launch.REPO, _launch.child_env

# find_spec, not importorskip: importing trl here would cost the test process seconds for nothing
pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs trl"),
    pytest.mark.slow,
]  # torchrun, two ranks importing trl and training: about a minute
TIMEOUT = 170  # the ranks' own collective timeout (ddp_timeout) is 60 s


def test_trl_grpo_two_ranks_halt_together(tmp_path):
    r0, r1 = run_torchrun(HERE / "trl_ddp_run.py", 2, tmp_path, env=child_env(), cwd=REPO, timeout=TIMEOUT)
    FAULT_STEP = r0["fault_step"]  # the script's constant (importing it here would import trl)
    assert FAULT_STEP >= 1
    for r, res in enumerate((r0, r1)):
        assert (res["world"], res["guard_rank"], res["guard_world"], res["backend"]) == (2, r, 2, "gloo")
        assert res["decisions"][-1] == [FAULT_STEP, "checkpoint_and_halt", True]
        assert [d[1] for d in res["decisions"][:-1]] == [None] * FAULT_STEP
        assert res["global_step"] == FAULT_STEP + 1  # the trainer stopped right after the halted step
        assert res["finite"]
        # named by the trainer's global_step after the halted step (decisions record it before the step)
        assert res["checkpoint"].endswith(f"step_{FAULT_STEP + 1:08d}/rank{r}.pt")
        # guard collectives per step: MAX (header + maxima) and SUM; the halted step adds the save flag
        assert [len(c) for c in res["check_calls"]] == [2] * FAULT_STEP + [3]
    assert r0["check_calls"] == r1["check_calls"]
    assert r0["decisions"] == r1["decisions"] and r0["digest"] == r1["digest"]
    incidents = (tmp_path / "guard" / "incidents.jsonl").read_text().splitlines()
    assert len(incidents) == 1 and json.loads(incidents[0])["rule"] == "nonfinite_grad"
