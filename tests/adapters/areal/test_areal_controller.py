"""AReaL's default launch (single controller): rl_guard's ``PPOTrainer`` builds AReaL's ``PPOActorController``
with the guarded engine class, and AReaL's own worker RPC app (areal 1.0.4, ``areal.infra.rpc.rpc_server``'s
blueprints, driven in process through Flask's test client) imports that class by its dotted path, gets the
guard's settings through ``/set_env`` and trains it through ``/call compute_logp | compute_advantages |
ppo_update``. See ``controller_worker.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# AReaL's imports and one FSDP2 engine: about 20 s; slower on a loaded machine
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def test_single_controller_workers_import_and_run_the_guarded_engine(tmp_path):
    sys.path.insert(0, str(ROOT / "integrations" / "areal_async"))
    from tiny_qwen2 import build

    model = build(tmp_path / "model")
    env = {
        **os.environ,  # tests/: the worker imports the shared rank_launch helpers
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH")])),
    }
    env.pop("AREAL_SPMD_MODE", None)
    proc = subprocess.run(
        [sys.executable, str(HERE / "controller_worker.py"), str(model), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=500,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["single_controller"] and out["engine_path"] == "rl_guard.adapters.areal_engine.GuardedFSDPPPOActor"
    assert out["worker_env"] == ["RL_GUARD_CONFIG", "RL_GUARD_MAX_HEAD_OFFPOLICYNESS", "RL_GUARD_RUN_DIR"]
    # the worker's guard observed AReaL's loss inputs and decided in its optimizer_step
    assert out["healthy"] == {"step": 1, "skipped": 0, "rl_guard/lag/max": 1.0, "rl_guard/behave_imp_weight/min": 1.0}
    assert out["far"]["skipped"] == 1 and out["far"]["rl_guard/behave_imp_weight/min"] == pytest.approx(0.1353353)
    assert "rl_guard.adapters.areal_trainer import PPOTrainer" in out["proxy_error"]
