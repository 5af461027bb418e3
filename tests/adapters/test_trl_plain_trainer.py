"""The callback on a plain transformers ``Trainer`` (supervised causal-LM on the tiny model): gradient, loss and
non-finite rules work, there are no token statistics, nothing crashes."""

from __future__ import annotations

import math

import pytest
import torch

STEPS, INF_GRAD_STEP, NAN_LOSS_STEP = 6, 2, 4
# loss_above_one fires on the first (finite) loss, then is quiet for 100 steps unless a value is non-finite.
GUARD = """
rules:
  - {name: grad_norm_ceiling, metric: rl_guard/grad/norm, op: ">", threshold: 1000, action: skip_step}
  - {name: loss_ceiling, metric: rl_guard/loss/value, op: ">", threshold: 1000, action: skip_step}
  - {name: loss_above_one, metric: rl_guard/loss/value, op: ">", threshold: 1.0, cooldown_steps: 100, action: warn}
"""


@pytest.fixture(scope="module")
def plain_run(tiny_model, step_states, tmp_path_factory):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Trainer, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    from rl_guard.adapters.trl import RLGuardCallback
    from rl_guard.demo.faults import FaultInjector
    from rl_guard.demo.tiny import DIGITS

    tok = PreTrainedTokenizerFast.from_pretrained(str(tiny_model))
    texts = [" ".join(DIGITS[(i + j) % 10] for j in range(6)) for i in range(64)]
    ids = [tok(t)["input_ids"] for t in texts]
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})

    class NaNLossOnce(Trainer):
        """A loss that turns NaN at one step (e.g. a numerically unstable custom loss)."""

        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            return loss * math.nan if self.state.global_step == NAN_LOSS_STEP else loss

    tmp = tmp_path_factory.mktemp("plain")
    callback = RLGuardCallback(GUARD, run_dir=str(tmp / "guard"))
    states = step_states(steps=(INF_GRAD_STEP, NAN_LOSS_STEP, STEPS - 1))
    args = TrainingArguments(
        output_dir=str(tmp / "trainer"),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        max_grad_norm=1.0,
    )
    trainer = NaNLossOnce(
        model=AutoModelForCausalLM.from_pretrained(str(tiny_model)),
        args=args,
        train_dataset=data,
        callbacks=[FaultInjector("inf_grad", at_step=INF_GRAD_STEP), callback, states],
    )
    trainer.pop_callback(PrinterCallback)
    trainer.train()
    return trainer, callback.guard, states


# Steps the guard writes are the trainer's global_step after the step: the step that starts at global_step s is s + 1.
def _incidents(guard):
    from rl_guard.sinks.jsonl import read_jsonl

    return read_jsonl(guard.run_dir / "incidents.jsonl")


def _metrics(guard):
    from rl_guard.sinks.jsonl import read_jsonl

    return read_jsonl(guard.run_dir / "metrics.jsonl")


def _unchanged(states, step) -> bool:
    before, after = states.begin[step]["model"], states.end[step]["model"]
    return all(torch.equal(t, after[n]) for n, t in before.items())


def test_inf_grad_is_skipped_by_the_grad_rules(plain_run):
    trainer, guard, states = plain_run
    fired = {i["rule"]: i["action"] for i in _incidents(guard) if i["step"] == INF_GRAD_STEP + 1}
    assert fired == {"nonfinite_grad": "skip_step", "grad_norm_ceiling": "skip_step"}
    assert _unchanged(states, INF_GRAD_STEP)


def test_loss_rule_fires_on_a_finite_loss(plain_run):
    trainer, guard, _ = plain_run
    first = [i for i in _incidents(guard) if i["step"] == 1]
    assert [(i["rule"], i["action"]) for i in first] == [("loss_above_one", "warn")]
    logged = next(h["loss"] for h in trainer.state.log_history if h.get("step") == 1 and "loss" in h)
    assert first[0]["value"] == pytest.approx(logged, rel=1e-5)


def test_nan_loss_is_skipped(plain_run):
    trainer, guard, states = plain_run
    fired = {i["rule"]: i["action"] for i in _incidents(guard) if i["step"] == NAN_LOSS_STEP + 1}
    # A NaN fires every rule on its metric, bypassing cooldown; the gradients of a NaN loss are NaN too.
    assert fired == {
        "nonfinite_loss": "skip_step",
        "loss_ceiling": "skip_step",
        "loss_above_one": "warn",
        "nonfinite_grad": "skip_step",
        "grad_norm_ceiling": "skip_step",
    }
    record = next(m for m in _metrics(guard) if m["step"] == NAN_LOSS_STEP + 1)
    assert record["rl_guard/loss/nonfinite"] == 1
    assert _unchanged(states, NAN_LOSS_STEP)


def test_training_completes_with_loss_and_grad_metrics_only(plain_run):
    trainer, guard, states = plain_run
    assert trainer.state.global_step == STEPS and guard.controller.skipped_steps == 2
    assert all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())
    assert not _unchanged(states, STEPS - 1)  # later steps update the weights again
    by_step = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    for record in _metrics(guard):
        names = {k.split("/")[1] for k in record if k.startswith("rl_guard/")}
        assert names <= {"grad", "loss", "guard", "update", "optim"}, names  # no token statistics without a token batch
        if record["step"] - 1 not in (INF_GRAD_STEP, NAN_LOSS_STEP):
            log = by_step[record["step"]]
            assert record["rl_guard/loss/value"] == pytest.approx(log["loss"], rel=1e-5)
            assert record["rl_guard/grad/norm"] == pytest.approx(log["grad_norm"], rel=1e-5)


def test_no_token_counts_without_a_token_batch(plain_run):
    # Left out rather than NaN: a rule on a NaN metric would fire every step.
    _, guard, _ = plain_run
    assert not [k for m in _metrics(guard) for k in m if k.startswith("rl_guard/tokens/")]
