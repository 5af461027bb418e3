"""Snapshots reuse the buffers of the snapshot the ring is about to drop: same values bit for bit as a fresh
capture, no new tensors once the ring is full, and a rollback still restores the chosen state exactly."""

import torch

from rl_guard.control.checkpoint import SnapshotRing
from rl_guard.control.state import TrainState


def _state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, TrainState(model, opt)


def _train(model, opt):
    model(torch.randn(3, 4)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def test_capture_into_a_discarded_snapshot_is_exact_and_allocates_no_tensor():
    model, opt, state = _state()
    _train(model, opt)
    old = state.capture(1)
    _train(model, opt)
    fresh = state.capture(2)
    old_ptrs = [t.data_ptr() for t in _tensors(old["model"]) + _tensors(old["optimizer"])]
    reused = state.capture(2, reuse=old)
    got = _tensors(reused["model"]) + _tensors(reused["optimizer"])
    assert [t.data_ptr() for t in got] == old_ptrs  # written into the old buffers
    want = _tensors(fresh["model"]) + _tensors(fresh["optimizer"])
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want))
    assert reused["optimizer"]["param_groups"] == fresh["optimizer"]["param_groups"]
    _train(model, opt)  # training on does not reach into the snapshot
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_ring_hands_out_its_oldest_only_when_full_and_rollback_restores_it_exactly():
    model, opt, state = _state()
    ring = SnapshotRing(keep=2)
    assert ring.take_oldest_if_full() is None
    saved = {}
    for step in range(1, 5):
        _train(model, opt)
        saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
        ring.push(state.capture(step, reuse=ring.take_oldest_if_full()))
    assert ring.steps() == [3, 4]
    _train(model, opt)
    state.restore(ring.latest(before_step=4))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved[3].items())
