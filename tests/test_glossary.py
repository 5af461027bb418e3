"""The glossary documents every metric the guard emits, and docs/glossary.md is generated from it."""

from pathlib import Path

import torch

from rl_guard import Guard, TokenBatch, glossary
from rl_guard.diagnostics import SampleBatch

ROOT = Path(__file__).resolve().parents[1]


def test_docs_glossary_is_generated_from_the_code():
    assert (ROOT / "docs" / "glossary.md").read_text() == glossary.markdown(), (
        "docs/glossary.md is stale: regenerate with `python -m rl_guard.glossary > docs/glossary.md`"
    )


def test_every_emitted_metric_is_documented(tmp_path):
    torch.manual_seed(0)
    b, t = 6, 10
    logp = -torch.rand(b, t)
    guard = Guard.from_yaml("rules: []", run_dir=tmp_path)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.1)
    guard.attach(model, opt)
    guard.observe(
        TokenBatch(
            logp,
            torch.ones(b, t, dtype=torch.bool),
            old_logprobs=logp + 0.1 * torch.randn(b, t),
            prox_logprobs=logp + 0.05 * torch.randn(b, t),
            ref_logprobs=logp - 0.1,
            entropy=torch.rand(b, t),
            advantages=torch.randn(b),
            versions=torch.arange(b),
            current_version=7,
            rewards=torch.rand(b),
            truncated=torch.zeros(b, dtype=torch.bool),
        ),
        loss=torch.tensor(0.5),
    )
    guard.observe_samples(
        SampleBatch(
            rewards=[1.0, 0.0, 0.5, 0.5],
            group_ids=[0, 0, 1, 1],
            outcome=[1, 0, 1, 1],
            lengths=[3, 4, 5, 6],
            values=[0.5, 0.1, 0.4, 0.6],
            returns=[1.0, 0.0, 0.5, 0.5],
        )
    )
    model(torch.randn(4, 3)).sum().backward()
    guard.check()
    names = set(guard.last_metrics)
    assert len(names) > 150
    unknown = sorted(n for n in names if not glossary.is_known(n))
    assert unknown == []
    assert (
        not glossary.is_known("rl_guard/ratio/p42") and glossary.closest("rl_guard/ratio/p98") == "rl_guard/ratio/p99"
    )
