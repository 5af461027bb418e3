"""One device->host transfer per optimizer step, and no other host read of a device value.

Every way a tensor value can reach Python is instrumented (``.cpu()``, ``.item()``, ``.tolist()``, ``.numpy()``,
``bool/float/int(t)`` and ``.to(cpu)`` from another device). On CPU nothing is really copied, but each of these
calls would synchronise a GPU, so counting them on CPU is the test. ``.numpy()`` on the very tensor returned by the
counted ``.cpu()`` is the host view of that one transfer, not a second one.
"""

from __future__ import annotations

import pytest
import torch

from rl_guard.stats.accumulate import StepAccumulator
from rl_guard.stats.batch import TokenBatch
from rl_guard.stats.grads import param_groups_of, probe_grads
from rl_guard.stats.probe_batch import probe_batch
from rl_guard.stats.kernels import loss_stats
from rl_guard.stats.partial import Partial
from rl_guard.stats.summarize import summarize

READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__")


@pytest.fixture
def host_reads(monkeypatch):
    calls = {"cpu": 0, "to_cpu": 0, **{n: 0 for n in READS}}
    transferred = set()
    orig = {n: getattr(torch.Tensor, n) for n in ("cpu", "to", *READS)}

    def cpu(self, *a, **k):
        calls["cpu"] += 1
        out = orig["cpu"](self, *a, **k)
        transferred.add(id(out))
        return out

    def to(self, *a, **k):
        out = orig["to"](self, *a, **k)
        if self.device.type != "cpu" and out.device.type == "cpu":
            calls["to_cpu"] += 1
        return out

    def read(name):
        def wrapped(self, *a, **k):
            if not (name == "numpy" and id(self) in transferred):
                calls[name] += 1
            return orig[name](self, *a, **k)
        return wrapped

    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    monkeypatch.setattr(torch.Tensor, "to", to)
    for n in READS:
        monkeypatch.setattr(torch.Tensor, n, read(n))
    return calls


def micro_batch(seed, packed=False):
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 33
    lp = -torch.rand(B, T, generator=g)
    d = dict(logprobs=lp, mask=torch.rand(B, T, generator=g) > 0.2, old_logprobs=lp + 0.1 * torch.randn(B, T, generator=g),
             prox_logprobs=lp + 0.05 * torch.randn(B, T, generator=g), ref_logprobs=lp + 0.1 * torch.randn(B, T, generator=g),
             entropy=torch.rand(B, T, generator=g), advantages=torch.randn(B, generator=g),
             versions=torch.randint(0, 4, (B, T), generator=g), current_version=4, rewards=torch.randn(B, generator=g),
             truncated=torch.rand(B, generator=g) < 0.5)
    if packed:
        for k in ("logprobs", "mask", "old_logprobs", "prox_logprobs", "ref_logprobs", "entropy", "versions"):
            d[k] = d[k].reshape(-1)
        d["cu_seqlens"] = torch.arange(0, B * T + 1, T)
    return TokenBatch(**d, importance_sampling_level="sequence" if seed % 2 else "token")


def model_with_grads():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model(torch.randn(3, 8)).pow(2).sum().backward()
    return torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[2].parameters()}])


def test_four_micro_batch_step_transfers_once(host_reads):
    opt = model_with_grads()
    batches = [micro_batch(i, packed=i == 3) for i in range(4)]  # built outside: validation is host-only anyway
    acc = StepAccumulator()
    for b in batches:
        acc.add(probe_batch(b))
        p = Partial()
        loss_stats(p, torch.tensor(0.5))
        acc.add(p)
    acc.add(probe_grads(param_groups_of(opt), pre_clip_norm=torch.tensor(1.5)))
    raw = acc.finish()
    assert host_reads["cpu"] == 1, host_reads
    assert {k: v for k, v in host_reads.items() if k != "cpu"} == {"to_cpu": 0, **{n: 0 for n in READS}}
    metrics, _ = summarize(raw)  # host side only (numpy): still no tensor read
    assert host_reads["cpu"] == 1 and sum(host_reads.values()) == 1
    assert metrics["rl_guard/tokens/microbatches"] == 4 and metrics["rl_guard/loss/value"] == 2.0


def test_the_counter_sees_a_sync(host_reads):
    """Guard against a counter that counts nothing: a stray .item() and a bool() are seen."""
    t = torch.ones(3)
    t.sum().item()
    bool(t.any())
    assert host_reads["item"] == 1 and host_reads["__bool__"] == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_sync_on_cuda_under_sync_debug_mode():
    dev = torch.device("cuda")
    batches = []
    for i in range(4):
        b = micro_batch(i, packed=i == 3)
        kw = {f.name: getattr(b, f.name) for f in b.__dataclass_fields__.values()}
        kw = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        batches.append(TokenBatch(**kw))
    model = torch.nn.Linear(8, 2).to(dev)
    model(torch.randn(3, 8, device=dev)).sum().backward()
    torch.cuda.synchronize()
    acc = StepAccumulator()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for b in batches:
            acc.add(probe_batch(b))
        acc.add(probe_grads(param_groups_of(model)))
        sums = acc.pack()[1]  # everything up to the single transfer
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sums.is_cuda
    assert summarize(acc.finish())[0]["rl_guard/tokens/microbatches"] == 4
