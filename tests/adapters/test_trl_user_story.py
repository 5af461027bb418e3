"""The TRL user's whole loop, run as the user runs it: their own script, ``RLGuardCallback("grpo")`` with the shipped
preset unmodified, TRL's defaults (beta=0, num_iterations=1, max_grad_norm=1.0), tqdm off so TRL prints its log
dicts. A gradient turns inf at step 6 and the reward function breaks for good at step 12; the guard drops those
updates, says so on the console, halts at the 5th dropped update in a row and names the checkpoint; the user resumes
from it; the resumed guard is exactly as armed as the one that saved and halts at the first resumed step, since the
fault is still there; a second fresh run in the same output_dir leaves the first run's records alone."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent('''
    import json, os, sys
    import torch
    from trl import GRPOConfig, GRPOTrainer
    from transformers import TrainerCallback
    from rl_guard.adapters.trl import RLGuardCallback
    from rl_guard.demo.faults import FaultInjector
    from rl_guard.demo.tiny import build_tiny_model, prompt_dataset, repeat_last_digit_reward

    out, model_dir, resume = sys.argv[1], sys.argv[2], (sys.argv[3] if len(sys.argv) > 3 else None)
    torch.set_num_threads(1)
    if not os.path.exists(model_dir):
        build_tiny_model(model_dir, seed=0)

    class Armed(TrainerCallback):
        """What the guard holds right after it attached (after the resume loaded its state)."""
        def __init__(self, cb):
            self.cb, self.at_begin = cb, None
        def on_train_begin(self, args, state, control, **kw):
            self.at_begin = self.cb.guard.controller.state_dict()

    nan_rewards = FaultInjector("nan_rewards", at_step=12)
    guard = RLGuardCallback("grpo")
    armed = Armed(guard)
    args = GRPOConfig(output_dir=out, max_steps=24, per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=8, use_cpu=True, bf16=False, report_to=["tensorboard"],
                      logging_steps=1, disable_tqdm=True, learning_rate=1e-4)
    trainer = GRPOTrainer(model=model_dir, args=args, train_dataset=prompt_dataset(64, seed=0),
                          reward_funcs=[nan_rewards.faulty_reward(repeat_last_digit_reward)],
                          callbacks=[FaultInjector("inf_grad", at_step=6), nan_rewards, guard, armed])
    trainer.train(resume_from_checkpoint=resume)
    result = {"stopped": guard.stopped, "summary": guard.summary, "run_dir": str(guard.guard.run_dir),
              "armed": armed.at_begin, "global_step": trainer.state.global_step}
    print("RESULT " + json.dumps(result, default=str))
''')


def run_script(tmp: Path, out: Path, *resume: str) -> tuple[str, dict]:
    script = tmp / "train_grpo.py"
    script.write_text(SCRIPT, encoding="utf-8")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, str(script), str(out), str(tmp / "model"), *resume],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-4000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    return console, result


def guard_lines(console: str) -> list[str]:
    return [line for line in console.splitlines() if line.startswith("rl_guard: [rule ")]


def digest(run_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(run_dir.glob("*.jsonl"))}


def test_fault_halt_resume_and_a_second_run(tmp_path):
    out = tmp_path / "grpo"
    console, first = run_script(tmp_path, out)
    lines = guard_lines(console)

    # -- the faults on the console: rule, metric, value against the threshold, action, what happened ---------------
    assert any(
        "[rule nonfinite_grad] rl_guard/grad/nonfinite = 1 > 0 at step 7" in line
        and "-> skip_step: the update was dropped" in line
        for line in lines
    ), lines
    assert any(
        "[rule nonfinite_rewards] rl_guard/input/rewards/nonfinite" in line
        and "at step 13" in line
        and "-> skip_step: the update was dropped" in line
        for line in lines
    ), lines
    stop = first["stopped"]
    assert stop is not None and stop["decision"] == "checkpoint_and_halt" and stop["step"] == 17, stop
    assert first["global_step"] == 17  # halted, not run to max_steps=24
    halt_line = next(line for line in lines if "at step 17" in line and "training halts" in line)
    assert stop["checkpoint"] in halt_line
    # every action of the preset's rules was said once per firing, on its own line (not glued to other output)
    incidents = [json.loads(x) for x in (out / "rl_guard" / "incidents.jsonl").read_text().splitlines()]
    acted = [i for i in incidents if i["action"] != "warn"]
    assert len([line for line in lines if "-> warn" not in line]) == len(acted) >= 6

    # -- the summary: reason, checkpoint, how to resume, the report command -------------------------------------
    summary = "\n".join(first["summary"])
    halted_at = out / "checkpoint-17"
    assert f"stopped at step 17 by rule {stop['rule']}" in summary
    assert f'trainer.train(resume_from_checkpoint="{halted_at}")' in summary
    assert f"rl-guard report {out / 'rl_guard'}" in summary
    assert summary in console
    assert first["run_dir"] == str(out / "rl_guard")  # under the trainer's output_dir

    # -- the printed TRL lines stay readable; tensorboard still receives every metric ---------------------------
    printed = [ast.literal_eval(line) for line in console.splitlines() if line.startswith("{'loss'")]
    assert printed and max(sum(k.startswith("rl_guard/") for k in p) for p in printed) <= 15
    assert max(len(line) for line in console.splitlines() if line.startswith("{'loss'")) < 1600
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next(out.glob("runs/*"))), size_guidance={"scalars": 0})
    events.Reload()
    assert sum(tag.startswith("train/rl_guard/") for tag in events.Tags()["scalars"]) > 100

    # -- the guard's state is in the halt checkpoint; resuming restores it and re-meets the fault at once --------
    assert (halted_at / "rl_guard_state_rank0.pt").is_file()
    saved = torch.load(halted_at / "rl_guard_state_rank0.pt", weights_only=True)["controller"]
    before = digest(out / "rl_guard")
    console2, resumed = run_script(tmp_path, out, str(halted_at))
    assert resumed["armed"]["step"] == saved["step"] == 18
    assert resumed["armed"]["skipped_steps"] == saved["skipped_steps"] == 6
    assert resumed["armed"]["dropped_streak"] == saved["dropped_streak"] == 5
    assert resumed["armed"]["history"] == json.loads(json.dumps(saved["history"], default=str))
    assert f"rl_guard: resumed from {halted_at}: step 18" in console2
    assert "WARNING: this checkpoint was saved when rule" in console2  # the halt's checkpoint holds the fault
    assert resumed["stopped"]["step"] == 18 and resumed["stopped"]["decision"] == "checkpoint_and_halt"
    assert resumed["global_step"] == 18  # acted on at the first resumed step
    steps = [json.loads(x)["step"] for x in (out / "rl_guard" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 19))  # the same records, continued, no duplicate
    # the update probe's weight reference came back too: the loaded weights are compared with the saved run's
    resumed_step = json.loads((out / "rl_guard" / "metrics.jsonl").read_text().splitlines()[-1])
    assert resumed_step["step"] == 18 and resumed_step["rl_guard/update/external_rel"] == 0.0
    after_resume = digest(out / "rl_guard")

    # -- a second fresh run in the same output_dir: its own records, the first run's unchanged -------------------
    console3, second = run_script(tmp_path, out)
    assert second["run_dir"] == str(out / "rl_guard-2")
    assert f"holds another run's records; this run writes to {out / 'rl_guard-2'}" in console3
    assert digest(out / "rl_guard") == after_resume != before
    second_steps = [json.loads(x)["step"] for x in (out / "rl_guard-2" / "metrics.jsonl").read_text().splitlines()]
    assert second_steps == list(range(1, 18))
