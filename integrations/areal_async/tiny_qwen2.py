"""A tiny Qwen2 causal LM with the project's word-level tokenizer, built locally (no downloads).

Qwen2 rather than the Llama of ``rl_guard.demo.tiny``: AReaL packs every micro-batch into one row and passes
``attention_mask={"full_attention": None, "sliding_attention": None}`` (fsdp_engine.py, ``_prepare_mb_list``),
the per-layer mask mapping that Qwen2's forward accepts in transformers 5.3 and Llama's does not."""

from __future__ import annotations

import sys
from pathlib import Path


def build(path: str | Path, seed: int = 0) -> Path:
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from rl_guard.demo.tiny import build_tiny_model

    path = Path(path)
    build_tiny_model(path, seed=seed)  # tokenizer (and a Llama, replaced below)
    tok = AutoTokenizer.from_pretrained(path)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    for f in path.glob("*.safetensors"):
        f.unlink()
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


if __name__ == "__main__":
    print(build(sys.argv[1]))
