"""The plain-PyTorch GRPO recipe under DDP (gloo, 2 processes) behaves like the single-process one."""

from __future__ import annotations

import json

import numpy as np
from dist_scenarios import RECIPE_STEPS
from file_modules import ROOT, load_module

from rl_guard.demo.run import PRESET
from rl_guard.glossary import comparable

train = load_module("pytorch_grpo_train", ROOT / "integrations" / "pytorch_grpo" / "train.py")


def test_healthy_ddp_run_matches_single_process(launched, tmp_path):
    run = launched(2)
    r0, r1 = run.scenario("recipe")
    single = train.run(str(PRESET), steps=RECIPE_STEPS, run_dir=str(tmp_path / "single"), prompts_per_step=16)
    for res in (r0, r1):
        assert res["finite"] and res["steps_run"] == RECIPE_STEPS
        assert {a for _, a, _ in res["decisions"]} <= {"warn"}  # no skip, stop or rollback
    assert {a for _, a, _ in single.decisions} <= {"warn"}
    assert len(r0["records"]) == len(r1["records"]) == 2 * RECIPE_STEPS
    for a, b in zip(r0["records"], r1["records"]):
        assert a["digest"] == b["digest"]  # DDP keeps the weights bit-identical, and no rank acted alone
        assert comparable(a["metrics"]) == comparable(b["metrics"])  # the same merged metrics on both ranks
        assert a["metrics"]["rl_guard/tokens/count"] == a["local_tokens"] + b["local_tokens"]
    ddp = [json.loads(line) for line in (run.out / "recipe" / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(line) for line in (tmp_path / "single" / "metrics.jsonl").read_text().splitlines()]
    assert len(ddp) == len(ref) == 2 * RECIPE_STEPS

    def mean(rows, key):
        return float(np.mean([row[key] for row in rows]))

    # Same global batch (16 prompts x 4) and initial weights, different samples: close, not equal.
    rel = {
        "tokens/count": 0.1,
        "entropy/mean": 0.05,
        "length/mean": 0.1,
        "adv/std": 0.1,
        "ratio/p99": 0.05,
        "grad/norm": 0.25,
    }
    for key, tol in rel.items():
        k = "rl_guard/" + key
        assert abs(mean(ddp, k) - mean(ref, k)) <= tol * abs(mean(ref, k)), (key, mean(ddp, k), mean(ref, k))
    for key, tol in {"ratio/p50": 0.01, "reward/mean": 0.05, "clip/region_frac": 0.05}.items():
        k = "rl_guard/" + key
        assert abs(mean(ddp, k) - mean(ref, k)) <= tol, (key, mean(ddp, k), mean(ref, k))
    # First update, identical weights on both sides: on-policy ratio exactly 1, entropy of the same policy.
    assert ddp[0]["rl_guard/ratio/p99"] == ref[0]["rl_guard/ratio/p99"] == 1.0
    assert abs(ddp[0]["rl_guard/entropy/mean"] - ref[0]["rl_guard/entropy/mean"]) < 0.01
