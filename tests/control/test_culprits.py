"""Culprits of token families: when a rule acts, the incident names the micro-batch rows that drove it (most extreme
first), computed and read on the host only then; the incident bundle holds them with what the adapter knows of each
row."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from rl_guard import Guard, TokenBatch
from rl_guard.sinks.jsonl import read_jsonl
from rl_guard.stats.culprits import host_candidates, sequence_extremes

ENTROPY_RULE = """
quarantine: {culprits: 2}
rules:
  - {name: low_entropy, metric: rl_guard/entropy/mean, op: "<", threshold: 100.0, action: skip_step}
"""


def _batch(entropy_rows, nan_row=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, t = len(entropy_rows), 6
    logprobs = -torch.rand(b, t, generator=g)
    if nan_row is not None:
        logprobs[nan_row, 2] = float("nan")
    entropy = torch.tensor(entropy_rows, dtype=torch.float32)[:, None].expand(b, t).clone()
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[:, -1] = False
    entropy[:, -1] = -1e9  # masked out: must not count
    return TokenBatch(logprobs=logprobs, mask=mask, entropy=entropy, old_logprobs=logprobs.detach().clone())


def test_sequence_extremes_match_a_float64_reference():
    rows = [2.0, 0.5, 1.5, 0.1, 3.0]
    batch = _batch(rows, nan_row=3)
    ext = sequence_extremes(batch, k=2)
    mean = np.array(rows)  # every valid token of a row has its row's entropy
    assert ext["entropy"][1].tolist() == list(np.argsort(mean)[:2])
    assert np.allclose(ext["entropy"][0].tolist(), sorted(mean)[:2], rtol=1e-6)  # float32 inputs
    assert ext["nonfinite_logprobs"][1][0].item() == 3 and ext["nonfinite_logprobs"][0][0].item() == 1
    assert ext["logratio"][1][0].item() == 3  # the NaN log-ratio ranks first


def test_host_candidates_merge_micro_batches_most_extreme_first():
    kept = [(_batch([2.0, 0.4, 1.0]), "mb0"), (_batch([0.3, 5.0]), "mb1")]
    found = host_candidates(kept, "entropy", 3, lambda ctx, row: {"prompt": f"{ctx}/row{row}"})
    assert [c["prompt"] for c in found] == ["mb1/row0", "mb0/row1", "mb0/row2"]
    assert [round(c["value"], 6) for c in found] == [0.3, 0.4, 1.0]


def test_an_acting_rule_names_its_culprit_rows_and_writes_a_bundle(tmp_path):
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard.from_yaml(ENTROPY_RULE, run_dir=tmp_path / "run").attach(model, opt)
    guard.describe_sequence = lambda ctx, row: {"prompt": ctx[row]}
    model(torch.ones(1, 3)).sum().backward()
    guard.observe(_batch([2.0, 0.25, 1.0]), context=["p0", "p1", "p2"])
    guard.observe(_batch([0.75, 3.0]), context=["q0", "q1"])
    decision = guard.check()
    guard.step_done()
    guard.close()
    assert decision.action == "skip_step"
    incident = next(i for i in read_jsonl(tmp_path / "run" / "incidents.jsonl") if i["rule"] == "low_entropy")
    assert [c["prompt"] for c in incident["culprits"]] == ["p1", "q0"]  # the two lowest-entropy sequences
    assert {c["family"] for c in incident["culprits"]} == {"entropy"}
    bundle = json.loads((Path(incident["bundle"]) / "bundle.json").read_text())
    assert [c["prompt"] for c in bundle["rules"][0]["culprits"]] == ["p1", "q0"]
    assert bundle["learning_rates"] == [0.1] and bundle["decision"] == "skip_step"
    assert guard.step_batches == []  # nothing kept past the step


REWARD_RULE = """
quarantine: {culprits: 1}
rules:
  - {name: reward_high, metric: rl_guard/reward/mean, op: ">", threshold: 5.0, action: skip_step}
"""


def test_reward_candidates_are_made_only_when_a_rule_acts(tmp_path):
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard.from_yaml(REWARD_RULE, run_dir=tmp_path / "run").attach(model, opt)
    made = []

    def candidates(prompt):
        made.append(prompt)
        return [{"prompt": prompt, "prompt_key": prompt, "reward": 9.0, "nonfinite": False}]

    decisions = []
    for step, reward in enumerate((1.0, 2.0, 9.0)):
        model(torch.ones(1, 3)).sum().backward()
        guard.observe_sequences(rewards=torch.full((4,), reward))
        guard.observe_culprits("rewards", lambda p=f"prompt{step}": candidates(p))
        decisions.append(guard.check().action)
        guard.step_done()
        opt.zero_grad()
    guard.close()
    assert decisions == [None, None, "skip_step"]
    assert made == ["prompt2"]  # the healthy steps never chose or described a candidate
    incident = next(i for i in read_jsonl(tmp_path / "run" / "incidents.jsonl") if i["rule"] == "reward_high")
    assert [c["prompt"] for c in incident["culprits"]] == ["prompt2"]


def test_reward_candidates_are_made_at_once_where_the_data_size_is_unknown(tmp_path):
    guard = Guard.from_yaml(REWARD_RULE.replace("{culprits: 1}", "{enabled: true, culprits: 1}"), run_dir=tmp_path)
    guard.observe_culprits("rewards", lambda: [{"prompt": "p", "prompt_key": "k1"}, {"prompt": "q"}])
    assert guard.quarantine.seen == {"k1"}  # the share of quarantined prompts counts the prompts seen
    guard.close()
