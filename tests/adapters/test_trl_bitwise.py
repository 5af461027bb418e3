"""A silent guard changes nothing: same seed, with and without the callback, bit-identical weights, optimizer
state and losses (the wrappers only read detached tensors and draw no random numbers)."""

from __future__ import annotations

import torch

SILENT = "rules: []\nsinks: [jsonl]\n"  # built-in non-finite rules stay on; nothing fires in a healthy run
STEPS = 6


def test_guarded_run_is_bitwise_identical_to_unguarded(grpo_run, same_state, tiny_model, tmp_path):
    plain = grpo_run(tmp_path / "plain", STEPS)
    guarded = grpo_run(tmp_path / "guarded", STEPS, guard=SILENT)
    assert guarded.guard.step == STEPS + 1 and guarded.incidents() == []  # the next step's number
    assert len(guarded.metrics()) == STEPS  # it did observe every step
    a, b = plain.trainer.model.state_dict(), guarded.trainer.model.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    same_state(plain.trainer.optimizer.state_dict(), guarded.trainer.optimizer.state_dict(), "optimizer")
    losses = lambda run: [h["loss"] for h in run.trainer.state.log_history if "loss" in h]  # noqa: E731
    assert losses(plain) == losses(guarded) and len(losses(plain)) == STEPS
    # And training did move the weights (the comparison is not between two untouched models).
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(str(tiny_model)).state_dict()
    assert any(not torch.equal(initial[n], a[n]) for n in a)
