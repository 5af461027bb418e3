"""One device->host transfer per optimizer step, and no other synchronising op, over whole guard steps.

``SyncDetector`` (tests/sync_detector.py) sees every op that would make a GPU wait: scalar reads, host reads,
data-dependent shapes, ``torch.equal``, device->host copies, collectives. It wraps ``observe``, ``check`` and
``step_done`` of a real ``Guard`` over several steps of padded and packed micro-batches with every optional field;
the only sync allowed is the step's transfer in ``rl_guard.stats.accumulate.to_host`` (``.cpu()`` of the packed
vector, then ``.numpy()`` of that host copy). The multi-process count with gloo is in
tests/distributed/test_sync_ranks.py; the CUDA check under ``set_sync_debug_mode("error")`` is at the end.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from stats_probes import packed, probe_batch
from sync_detector import SyncDetector
from torch.utils._python_dispatch import TorchDispatchMode

from rl_guard import Guard
from rl_guard.control.state import TrainState
from rl_guard.stats import accumulate, sequences, sketch
from rl_guard.stats.batch import TokenBatch
from rl_guard.stats.engines import Engine
from rl_guard.stats.on_device import device_vector, host_to_device

ASYNC = Path(__file__).resolve().parents[2] / "rl_guard" / "presets" / "async.yaml"
TRANSFER = ["Tensor.cpu", "Tensor.numpy"]  # the step's transfer: .cpu() of the packed vector, .numpy() of the copy
STEPS, MICRO = 4, 4
SNAPSHOT_STEP = 2  # snapshots: {healthy_steps: 3, every: 10} in the async preset


# The CPU tensors here stand for a GPU's: small CPU micro-batches, losses, gradients and weights would otherwise be
# read by numpy where they already are (host memory), which never happens on a GPU.
AS_ON_A_GPU = Engine("eager", host_max_tokens=0)


def micro_batch(seed: int, packed: bool = False, device="cpu") -> TokenBatch:
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 33
    lp = -torch.rand(B, T, generator=g)
    d = dict(
        logprobs=lp,
        mask=torch.rand(B, T, generator=g) > 0.2,
        old_logprobs=lp + 0.1 * torch.randn(B, T, generator=g),
        prox_logprobs=lp + 0.05 * torch.randn(B, T, generator=g),
        ref_logprobs=lp + 0.1 * torch.randn(B, T, generator=g),
        entropy=torch.rand(B, T, generator=g),
        advantages=torch.randn(B, generator=g),
        versions=torch.randint(0, 4, (B, T), generator=g),
        current_version=4,
        rewards=torch.randn(B, generator=g),
        truncated=torch.rand(B, generator=g) < 0.5,
    )
    if packed:
        for k in ("logprobs", "mask", "old_logprobs", "prox_logprobs", "ref_logprobs", "entropy", "versions"):
            d[k] = d[k].reshape(-1)
        d["cu_seqlens"] = torch.arange(0, B * T + 1, T)
    d = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in d.items()}
    return TokenBatch(**d, importance_sampling_level="sequence" if seed % 2 else "token")


class Loop:
    """A tiny model trained with a real guard (async preset: versions, lag buckets, rules with every action)."""

    def __init__(self, tmp_path, device="cpu"):
        torch.manual_seed(0)
        self.device = device
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to(device)
        self.opt = torch.optim.AdamW([{"params": self.model[0].parameters()}, {"params": self.model[2].parameters()}])
        self.guard = Guard.from_yaml(ASYNC, run_dir=tmp_path / "run").attach(self.model, self.opt)
        self.guard.use_host_reads(False)

    def step_inputs(self, step: int) -> list:
        # Built outside the detector: the caller's data, not the guard's work.
        batches = [micro_batch(step * MICRO + i, packed=i == MICRO - 1, device=self.device) for i in range(MICRO)]
        losses = [self.model(torch.randn(3, 8, device=self.device)).pow(2).mean() for _ in range(MICRO)]
        return list(zip(batches, losses))

    def run(self, det: SyncDetector, steps: int = STEPS) -> list[dict]:
        """Per step: the syncs seen in observe (all micro-batches), check and step_done."""
        out = []
        for step in range(steps):
            seen = {"observe": [], "check": [], "step_done": []}
            for batch, loss in self.step_inputs(step):
                value = loss.detach()
                # Everything the guard is handed lives on the device: a copy of it into host memory is a transfer.
                det.mark_device(value, *(v for v in vars(batch).values() if isinstance(v, torch.Tensor)))
                with det:
                    self.guard.observe(batch, loss=value)
                seen["observe"] += det.take()
                loss.backward()
            det.mark_device(*self.model.parameters(), *(p.grad for p in self.model.parameters()))
            with det:
                decision = self.guard.check()
            seen["check"] += det.take()
            if decision.apply_step:
                self.opt.step()
            self.opt.zero_grad()
            with det:
                self.guard.step_done()
            seen["step_done"] += det.take()
            out.append(seen)
        self.guard.close()
        return out


def test_whole_guard_steps_sync_only_in_the_one_transfer(tmp_path):
    loop = Loop(tmp_path)
    steps = loop.run(SyncDetector())
    assert loop.guard.internal_failures == 0 and loop.guard.step == STEPS
    assert loop.guard.last_metrics["rl_guard/tokens/microbatches"] == MICRO
    for step, seen in enumerate(steps):
        for call, events in seen.items():
            stray = [str(e) for e in events if e.site is None]
            assert stray == [], f"step {step}, {call}: synchronising ops outside the documented ones: {stray}"
        assert {e.site for e in seen["observe"]} <= {"cpu-only bincount"}
        assert [e.op for e in seen["check"] if e.site not in ("cpu-only bincount", "state capture")] == TRANSFER
        # The first check that passes keeps the starting state as a snapshot (one multi-tensor copy), once.
        starting = [e.op for e in seen["check"] if e.site == "state capture"]
        assert starting == (["aten._foreach_copy_.default"] if step == 0 else []), (step, starting)
        assert {e.function for e in seen["check"] if e.site == "step transfer"} == {"to_host"}
        # The async preset snapshots after 3 healthy steps (then every 10): the model's and the optimizer's tensors
        # go to the host in one multi-tensor copy, there only.
        copies = [e for e in seen["step_done"] if e.site == "state capture"]
        assert [e.op for e in copies] == (["aten._foreach_copy_.default"] if step == SNAPSHOT_STEP else []), (
            step,
            [str(e) for e in copies],
        )
        assert len(copies) == len(seen["step_done"])


# -- the detector is not blind: each kind the earlier Tensor-method counter missed, inside a guard call ----------
def _inject(monkeypatch, name, extra, module=sequences):
    """Wrap one kernel the guard calls on every micro-batch so that it also runs ``extra(args)`` (patched in every
    rl_guard module that imported it by name)."""
    original = getattr(module, name)

    def patched(*args, **kwargs):
        extra(args)
        return original(*args, **kwargs)

    for mod in [m for n, m in sys.modules.items() if n.startswith("rl_guard")]:
        if getattr(mod, name, None) is original:
            monkeypatch.setattr(mod, name, patched)


def _mask_select(args):
    loss = args[2]
    loss.reshape(-1)[loss.reshape(-1) > 0]


def _equal(args):
    torch.equal(args[2], args[2])


def _copy_to_host(args):
    torch.empty(args[2].shape).copy_(args[2])  # the loss is marked device-side (Loop.run)


def _index(args):
    list(range(args[2].reshape(-1)[:1].long().clamp(0, 2)[0]))  # range(t) goes through __index__


@pytest.mark.parametrize(
    "extra, kind, op",
    [
        (_mask_select, "data_dependent_shape", "aten.index.Tensor (boolean mask)"),
        (_equal, "compare", "aten.equal.default"),
        (_copy_to_host, "device_to_host", "aten.copy_.default"),
        (_index, "scalar_read", "Tensor.__index__"),
    ],
)
def test_an_injected_sync_inside_observe_is_caught(tmp_path, monkeypatch, extra, kind, op):
    _inject(monkeypatch, "loss_stats", extra)
    loop = Loop(tmp_path)
    steps = loop.run(SyncDetector(), steps=1)
    stray = [e for e in steps[0]["observe"] if e.site is None]
    assert [(e.kind, e.op) for e in stray] == [(kind, op)] * MICRO, [str(e) for e in stray]
    assert all(
        e.file.endswith("test_sync_count.py") and e.callers[1] == "patched" and "observe" in e.callers for e in stray
    )


def test_an_injected_nonzero_in_a_kernel_is_caught(tmp_path, monkeypatch):
    """A kernel that picks entries with ``torch.where(cond)`` (``nonzero`` underneath) instead of arithmetic."""
    _inject(monkeypatch, "count_cells", lambda args: torch.where(args[0]), module=sketch)
    loop = Loop(tmp_path)
    seen = loop.run(SyncDetector(), steps=1)[0]
    stray = [e for e in seen["observe"] + seen["check"] if e.site is None]
    assert stray and {(e.kind, e.op, e.function) for e in stray} == {
        ("data_dependent_shape", "aten.nonzero.default", "<lambda>")
    }
    assert all(e.callers[1] == "patched" and "observe" in e.callers for e in stray)


def test_a_copy_to_host_from_a_device_tensor_is_caught():
    det = SyncDetector()
    on_device = torch.randn(5)
    with det:
        det.mark_device(on_device)
        stats = on_device.square().cumsum(0)  # computed from device data: device-side too
        host = torch.empty(5)
        host.copy_(stats)
        kept = torch.empty(5)
        det.mark_device(kept)
        kept.copy_(stats)  # device -> device: not a sync
        stats.to(torch.device("cpu"))  # on a CPU run, the stand-in device itself: not a transfer
        stats.to("cpu")
        stats.cpu()
    assert [(e.kind, e.op) for e in det.events] == [
        ("device_to_host", "aten.copy_.default"),
        ("device_to_host", "Tensor.to(cpu)"),
        ("host_read", "Tensor.cpu"),
    ]


def _number_write_copies_from_host() -> bool:
    """Whether this torch writes ``t[i] = 7`` as a copy from a host 0-dim tensor (torch <= 2.14: a sync on CUDA)
    rather than as ``fill_`` with the number (torch 2.15: no host tensor, nothing to wait for)."""
    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.overloadpacket)
            return func(*args, **(kwargs or {}))

    with Ops():
        torch.zeros(2)[-1] = 7
    return torch.ops.aten.copy_ in seen


def test_a_blocking_copy_from_host_to_a_device_tensor_is_caught():
    """What synchronised on an H200 (torch 2.11) and a CPU run cannot see by itself: a Python number written into a
    device tensor (where this torch copies it from a host tensor), and host data copied to the device (a device
    object names the device on a CPU run) without pinned memory; ``host_to_device`` is the sanctioned way and is not
    counted, nor is filling on the device."""
    det = SyncDetector()
    on_device = torch.zeros(4)
    device = on_device.device
    with det:
        det.mark_device(on_device)
        made_there = torch.arange(4, device=device)  # made on the device: device-side
        made_there[-1] = 7
        made_there[-1:].fill_(7)
        on_device.copy_(torch.ones(4))
        torch.ones(4).to(device)
        torch.ones(4).to(device, non_blocking=True)
        torch.tensor([1.0, 2.0], device=device)
        torch.as_tensor(3.0, dtype=torch.float64, device=device)
        host_to_device(torch.ones(4), device, torch.float64)
        device_vector([1.0, 1.0, 2.0], device)
        on_device.to(device)  # already there
    number_write = [("host_to_device", "aten.copy_.default")] if _number_write_copies_from_host() else []
    assert [(e.kind, e.op) for e in det.events] == [
        *number_write,
        ("host_to_device", "aten.copy_.default"),
        ("host_to_device", "Tensor.to(device)"),
        ("host_to_device", "torch.tensor(device=...)"),
        ("host_to_device", "torch.as_tensor(device=...)"),
    ]


def test_the_step_transfer_is_recognised_only_inside_to_host():
    det = SyncDetector()
    acc = accumulate.StepAccumulator()
    acc.add(probe_batch(micro_batch(0), engine=AS_ON_A_GPU))
    with det:
        acc.finish()
        packed(acc)[1].cpu().numpy()  # the same calls elsewhere are not the documented transfer
    assert [(e.op, e.site) for e in det.events] == [
        ("Tensor.cpu", "step transfer"),
        ("Tensor.numpy", "step transfer"),
        ("Tensor.cpu", None),
        ("Tensor.numpy", None),
    ]


def test_a_documented_site_allows_only_its_own_ops():
    """A site that may use bincount (as count_cells does on CPU): any other sync inside it is still a stray."""

    def counter(index, size):
        return torch.bincount(index, minlength=size) + index.max().item() * 0

    det = SyncDetector(documented={"cpu-only bincount": (counter.__code__, {"aten.bincount.default"})})
    with det:
        counter(torch.tensor([0, 2, 2]), 4)
        torch.bincount(torch.tensor([1]))
    assert [(e.op, e.site) for e in det.events] == [
        ("aten.bincount.default", "cpu-only bincount"),
        ("Tensor.item", None),
        ("aten.bincount.default", None),
    ]


@pytest.mark.gpu
def test_no_sync_on_cuda_under_sync_debug_mode(tmp_path, monkeypatch):
    """observe -> check -> step_done on CUDA with every synchronisation an error, except in the step's transfer
    (``to_host``) and the healthy snapshot's copy to host memory (``TrainState.capture``)."""
    allowed = []

    def allow_syncs(name, fn):
        def wrapper(*args, **kwargs):
            allowed.append(name)
            torch.cuda.set_sync_debug_mode("default")
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("error")

        return wrapper

    monkeypatch.setattr(accumulate, "to_host", allow_syncs("transfer", accumulate.to_host))
    monkeypatch.setattr(TrainState, "capture", allow_syncs("snapshot", TrainState.capture))
    loop = Loop(tmp_path, device="cuda")

    def strict(call, *args, **kwargs):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return call(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    for step in range(STEPS):
        for batch, loss in loop.step_inputs(step):
            strict(loop.guard.observe, batch, loss=loss.detach())
            loss.backward()
        decision = strict(loop.guard.check)
        if decision.apply_step:
            loop.opt.step()
        loop.opt.zero_grad()
        strict(loop.guard.step_done)
        assert allowed == ["transfer"] + (["snapshot"] if step == SNAPSHOT_STEP else []), (step, allowed)
        allowed.clear()
    assert loop.guard.internal_failures == 0 and loop.guard.step == STEPS
    assert loop.guard.last_metrics["rl_guard/tokens/microbatches"] == MICRO
