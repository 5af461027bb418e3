"""TrainState.capture: host copies equal to the state dicts bit for bit, never aliased by training or by a later
capture, reused host buffers only once nothing refers to them, and a fresh layout when tensors are replaced."""

from __future__ import annotations

import io

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_guard.control.checkpoint import SnapshotRing
from rl_guard.control.state import TrainState


def _model():
    torch.manual_seed(0)
    # BatchNorm brings buffers, one of them int64 (num_batches_tracked).
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 2))


def _train(model, opt, sched=None, steps=1):
    for _ in range(steps):
        model(torch.randn(4, 6)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


def _reference(obj):
    """What capture must equal: every tensor cloned, containers rebuilt."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _reference(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_reference(v) for v in obj)
    return obj


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.device == b.device
            and torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b)
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _setup():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    _train(model, opt, sched)
    return model, opt, sched, TrainState(model, opt, sched)


def test_capture_equals_the_state_dicts_bit_for_bit_in_the_same_order():
    model, opt, sched, state = _setup()
    for step in range(3):  # the first capture builds the layout, the later ones reuse it
        snap = state.capture(step)
        assert _same(snap["model"], _reference(model.state_dict()))
        assert _same(snap["optimizer"], _reference(opt.state_dict()))
        assert _same(snap["scheduler"], _reference(sched.state_dict()))
        assert all(t.device.type == "cpu" for t in snap["model"].values())
        _train(model, opt, sched)


def test_held_snapshots_never_change():
    model, opt, sched, state = _setup()
    ring = SnapshotRing(keep=2)
    held = state.capture(0)
    frozen = _reference(held)
    for step in range(1, 8):
        _train(model, opt, sched)
        ring.push(state.capture(step))
        assert _same(held, frozen)  # training and later captures leave a held snapshot alone
    newest = ring.latest()
    assert _same(newest["model"], _reference(model.state_dict()))


def test_views_of_a_dropped_snapshot_keep_their_values():
    for share in (lambda t: t.view(-1), lambda t: torch.empty(0).set_(t.untyped_storage())):
        # a view (its base tensor stays referenced), then a tensor sharing only the storage (no base)
        model, opt, sched, state = _setup()
        snap = state.capture(0)  # the only host buffers so far: the next capture would take them if they looked free
        kept = share(snap["model"]["0.weight"])
        expected = kept.clone()
        del snap
        for step in range(1, 4):
            _train(model, opt, sched)
            state.capture(step)
        assert torch.equal(kept, expected)


def test_replaced_parameter_and_rebuilt_optimizer_state_are_captured():
    model, opt, sched, state = _setup()
    state.capture(0)
    with torch.no_grad():
        model[2].weight = torch.nn.Parameter(torch.randn(3, 5))  # new shape, new object
        model[2].bias = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state.optimizer, state.scheduler = opt, None
    _train(model, opt)
    snap = state.capture(1)
    assert _same(snap["model"], _reference(model.state_dict()))
    assert _same(snap["optimizer"], _reference(opt.state_dict()))
    opt.load_state_dict(opt.state_dict())  # new state tensors, same shapes
    _train(model, opt)
    assert _same(state.capture(2)["optimizer"], _reference(opt.state_dict()))


def test_restore_is_bit_for_bit_and_survives_saving():
    model, opt, sched, state = _setup()
    snap = state.capture(0)
    expected = _reference({"model": model.state_dict(), "optimizer": opt.state_dict(), "sched": sched.state_dict()})
    buf = io.BytesIO()
    torch.save(snap, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert _same(loaded["model"], snap["model"]) and _same(loaded["optimizer"], snap["optimizer"])
    for source in (snap, loaded):
        _train(model, opt, sched, steps=2)
        state.capture(1)  # a later capture must not reach into the one being restored
        state.restore(source)
        now = {"model": model.state_dict(), "optimizer": opt.state_dict(), "sched": sched.state_dict()}
        assert _same(_reference(now), expected)
        # The restored optimizer does not alias the snapshot: training on leaves the snapshot as it was.
        _train(model, opt, sched)
        assert _same(snap["optimizer"], expected["optimizer"])


def test_a_state_dict_hook_falls_back_to_the_generic_copy():
    model, opt, sched, state = _setup()

    def add_entry(module, sd, prefix, local_metadata):
        sd[prefix + "extra"] = torch.ones(2)
        return sd

    model._register_state_dict_hook(add_entry)
    for step in range(3):
        snap = state.capture(step)
        assert "extra" in snap["model"] and _same(snap["model"], _reference(model.state_dict()))
        assert _same(snap["optimizer"], _reference(opt.state_dict()))
        _train(model, opt, sched)


def test_a_module_shared_under_two_names_is_captured_under_both():
    torch.manual_seed(0)
    shared = torch.nn.Linear(4, 4)
    model = torch.nn.Sequential(shared, torch.nn.Tanh(), shared)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = TrainState(model, opt)
    for step in range(2):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        snap = state.capture(step)
        assert list(snap["model"]) == ["0.weight", "0.bias", "2.weight", "2.bias"]
        assert _same(snap["model"], _reference(model.state_dict()))
        assert _same(snap["optimizer"], _reference(opt.state_dict()))
    assert state._copies._model_entries  # the plain path, not the generic one


def test_mixed_dtypes_bfloat16_weights_with_float32_moments():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = TrainState(model, opt)
    for step in range(3):
        model(torch.randn(4, 6, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        snap = state.capture(step)
        assert {t.dtype for t in snap["model"].values()} == {torch.bfloat16}
        assert _same(snap["model"], _reference(model.state_dict()))
        assert _same(snap["optimizer"], _reference(opt.state_dict()))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.lists(st.one_of(st.none(), st.integers(0, 12)), max_size=20))
def test_the_ring_frees_exactly_the_snapshots_it_no_longer_offers(keep, ops):
    """``on_drop`` gets every snapshot pushed out or abandoned by a rollback (``drop_after``), once, and nothing the
    ring still offers: engine states free their checkpoint tags through it, so what is kept on disk is what can be
    restored (``None``: a push at the next step; an integer: a rollback to the newest snapshot up to that step)."""
    freed = []
    ring, pushed = SnapshotRing(keep=keep, on_drop=lambda snap: freed.append(snap["step"])), []
    for step, op in enumerate(ops, start=1):
        if op is None:
            ring.push({"step": step})
            pushed.append(step)
        else:
            ring.drop_after(op)
        assert len(freed) == len(set(freed))
        assert sorted(freed + ring.steps()) == pushed
        assert len(ring) <= keep
