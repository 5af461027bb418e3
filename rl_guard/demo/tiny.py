"""A tiny Llama and a word-level tokenizer built from scratch and saved locally: no downloads.

The task: prompts are a few digit words; the reward favours completions that repeat the prompt's last digit
and end with EOS. Small enough that a real ``GRPOTrainer`` takes well under a second per step on a CPU.
"""

from __future__ import annotations

import os
from pathlib import Path

# ``GRPOConfig`` settings of a GRPO run of this model on CPU: 8 completions per step, 4 per prompt, 8 tokens each,
# float32. And the demo's loss: a reference KL (beta > 0), two passes over each rollout batch, clipped gradients.
TINY_GRPO = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=8, use_cpu=True, bf16=False)
DEMO_LOSS = dict(beta=0.04, num_iterations=2, steps_per_generation=2, max_grad_norm=1.0)

DIGITS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]


def build_tiny_model(
    path: str | os.PathLike, seed: int = 0, hidden: int = 32, layers: int = 2, max_positions: int = 64
) -> Path:
    """Save a tiny LlamaForCausalLM and its tokenizer under ``path``; returns the path. ``max_positions``: the
    longest prompt + completion it takes."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate(SPECIAL + DIGITS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
    tok.padding_side = "left"
    tok.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        pad_token_id=vocab["<pad>"],
        bos_token_id=vocab["<bos>"],
        eos_token_id=vocab["<eos>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def prompt_dataset(n: int = 64, seed: int = 0):
    """A ``datasets.Dataset`` with a ``prompt`` column of digit words."""
    import random

    from datasets import Dataset

    rng = random.Random(seed)
    prompts = [" ".join(rng.choice(DIGITS) for _ in range(3)) for _ in range(n)]
    return Dataset.from_dict({"prompt": prompts})


def repeat_last_digit_reward(prompts, completions, **kwargs) -> list[float]:
    """1 per completion word equal to the prompt's last digit (up to 4), normalised to [0, 1]."""
    out = []
    for prompt, completion in zip(prompts, completions):
        target = prompt.split()[-1]
        words = completion.split()[:4]
        out.append(sum(w == target for w in words) / 4.0)
    return out


def length_penalty_reward(completions, **kwargs) -> list[float]:
    """A small cost per word beyond four (a second reward component, logged separately by TRL)."""
    return [-0.05 * max(0, len(c.split()) - 4) for c in completions]


def tiny_trainer(model_path, output_dir, *, injector=None, callbacks=(), prompts: int = 64, seed: int = 0, **settings):
    """A ``GRPOTrainer`` of the demo's setup on ``model_path``: ``TINY_GRPO`` and ``DEMO_LOSS``, learning rate 3e-3, no
    checkpoints, no reporting, both rewards on ``prompts`` prompts; ``injector`` (a ``FaultInjector``) comes first
    among the callbacks and wraps the first reward; ``settings`` add to or override ``GRPOConfig``'s."""
    from trl import GRPOConfig, GRPOTrainer

    config = {"learning_rate": 3e-3, "save_strategy": "no", "report_to": [], **TINY_GRPO, **DEMO_LOSS, **settings}
    first = injector.faulty_reward(repeat_last_digit_reward) if injector is not None else repeat_last_digit_reward
    return GRPOTrainer(
        model=str(model_path),
        args=GRPOConfig(output_dir=str(output_dir), seed=seed, **config),
        train_dataset=prompt_dataset(prompts, seed=seed),
        reward_funcs=[first, length_penalty_reward],
        callbacks=([injector] if injector is not None else []) + list(callbacks),
    )
