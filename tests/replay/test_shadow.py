"""``mode: shadow``: every action is only recorded (``"would"``); the run is bitwise the unguarded run."""

from __future__ import annotations

import pytest
import torch
from bitwise import assert_same
from replay_runs import quiet_demo_yaml

from rl_guard.control.config import load_config
from rl_guard.errors import ConfigError
from rl_guard.sinks.jsonl import read_jsonl


def test_mode_is_validated_with_its_line_and_allowed_values():
    assert load_config("version: 1\n").mode == "enforce"
    assert load_config("version: 1\nmode: shadow\n").mode == "shadow"
    with pytest.raises(ConfigError) as err:
        load_config("version: 1\nrules: []\nmode: dry_run\n")
    text = str(err.value)
    assert "mode (line 3)" in text and "'dry_run' is not allowed" in text and "enforce, shadow" in text


@pytest.mark.slow  # two real GRPO runs
def test_shadow_run_is_bitwise_identical_to_unguarded_and_records_what_it_would_do(grpo_pair):
    plain, shadowed, guard = grpo_pair(quiet_demo_yaml(mode="shadow"), fault="lr_blowup", at_step=3, steps=8)
    incidents = read_jsonl(guard.run_dir / "incidents.jsonl")
    would = [i for i in incidents if i["would"] != "warn"]
    # The fault made rules fire that would have dropped updates (rollback / skip / halt) ...
    assert would, incidents
    assert all(i["action"] == "warn" and i["mode"] == "shadow" and i["decision"] is None for i in incidents)
    assert all(f"-> would {i['would']} (shadow mode)" in i["message"] for i in incidents)
    # ... yet nothing was done: the run trained all its steps, every update applied, no checkpoint, no snapshot.
    assert shadowed.state.global_step == plain.state.global_step == 8
    assert guard.controller.skipped_steps == guard.controller.rollbacks == 0
    assert len(guard.actions.snapshots) == 0 and not (guard.run_dir / "checkpoints").exists()
    assert all(m["rl_guard/guard/skipped_steps"] == 0 for m in read_jsonl(guard.run_dir / "metrics.jsonl"))
    a, b = plain.model.state_dict(), shadowed.model.state_dict()
    assert all(bool(torch.isfinite(t).all()) for t in a.values())  # so equality below is a real comparison
    assert_same(a, b, "model")
    assert_same(plain.optimizer.state_dict(), shadowed.optimizer.state_dict(), "optimizer")
    assert_same(plain.lr_scheduler.state_dict(), shadowed.lr_scheduler.state_dict(), "scheduler")
    losses = lambda t: [h["loss"] for h in t.state.log_history if "loss" in h]  # noqa: E731
    assert losses(plain) == losses(shadowed)


@pytest.mark.slow  # a real GRPO run
def test_demo_shadow_switch_and_replay_agree_on_what_would_have_happened(tmp_path, capsys):
    """``rl-guard demo --shadow``: the incidents say what the guard would have done, and replaying the run's own
    metrics.jsonl with its config.yaml (enforce semantics) gives the same rules, steps and actions, escalations
    (no trusted snapshot, max_rollbacks, max_consecutive_skips) included."""
    from rl_guard.cli import main
    from rl_guard.replay import load_history, replay

    run = tmp_path / "shadow"
    main(["demo", "--shadow", "--steps", "16", "--fault-step", "6", "--run-dir", str(run)])
    text = capsys.readouterr().out
    live = read_jsonl(run / "incidents.jsonl")
    would = [i for i in live if i["would"] != "warn"]
    assert would and "shadow mode: the guard touched nothing" in text
    assert f"it would have acted first at step {would[0]['step']}:" in text and would[0]["message"] in text
    assert load_config(run / "config.yaml").mode == "shadow"
    result = replay(load_history(run), load_config(run / "config.yaml"))
    assert [(r["step"], r["rule"], r["action"], r["restored_to_step"]) for r in result.incidents] == [
        (i["step"], i["rule"], i["would"], i["would_restore_to_step"]) for i in live
    ]
    shadow_suffix = lambda m: m.replace("-> would ", "-> ").replace(" (shadow mode)", "")  # noqa: E731
    assert [r["message"] for r in result.incidents] == [shadow_suffix(i["message"]) for i in live]


def test_shadow_in_the_plain_pytorch_recipe_is_bitwise_the_unguarded_run_at_every_step(tmp_path):
    """integrations/pytorch_grpo/train.py with a policy-mismatch fault: at every optimizer step the weights,
    optimizer and scheduler state and torch's RNG are those of the unguarded twin, while the preset's rules fire."""
    import copy
    from pathlib import Path

    from file_modules import load_module

    from rl_guard import Guard

    root = Path(__file__).resolve().parents[2]
    recipe = load_module("pytorch_grpo_train_shadow", root / "integrations" / "pytorch_grpo" / "train.py")

    def states():
        seen = []

        def on_step(step, it, decision, model, opt, sched):
            seen.append(
                copy.deepcopy(
                    {
                        "step": (step, it),
                        "model": model.state_dict(),
                        "opt": opt.state_dict(),
                        "sched": sched.state_dict(),
                        "rng": torch.get_rng_state(),
                    }
                )
            )

        return seen, on_step

    plain, on_plain = states()
    recipe.run(None, steps=12, fault="policy_mismatch", fault_step=5, stop_on_nonfinite=False, on_step=on_plain)
    shadowed, on_shadow = states()
    preset = (root / "rl_guard" / "presets" / "grpo.yaml").read_text()
    guard = Guard.from_yaml(preset + "\nmode: shadow\n", run_dir=tmp_path / "guard")  # the shipped preset, in shadow
    res = recipe.run(
        None, steps=12, fault="policy_mismatch", fault_step=5, guard=guard, stop_on_nonfinite=False, on_step=on_shadow
    )
    incidents = read_jsonl(tmp_path / "guard" / "incidents.jsonl")
    assert [i for i in incidents if i["would"] != "warn"], incidents  # it would have acted
    assert res.steps_run == 12 and len(shadowed) == len(plain) == 24
    assert_same(plain, shadowed, "per-step state")


@pytest.mark.parametrize("mode", ["enforce", "shadow"])
def test_the_failure_policy_only_records_in_shadow_mode(mode, tmp_path):
    """fail_mode: closed drops the update of a step whose check failed; in shadow mode it only says it would have."""
    from rl_guard import Guard

    model = torch.nn.Linear(3, 2)
    guard = Guard.from_yaml(f"version: 1\nmode: {mode}\nfail_mode: closed\nrules: []\n", run_dir=tmp_path)
    guard.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.randn(4, 3)).sum().backward()
    with pytest.warns(RuntimeWarning, match="internal failure"):
        decision = guard.check(params=object())  # not parameters: the gradient probe fails inside the guard
    if mode == "shadow":  # the loop applies the step; the gradients are untouched
        assert (decision.action, decision.would, decision.apply_step) == (None, "skip_step", True)
        assert all(p.grad is not None for p in model.parameters())
    else:
        assert (decision.action, decision.would, decision.apply_step) == ("skip_step", None, False)
