"""Update-size probe: relative update, parameter norm and outside-the-optimizer change against float64 numpy
references; the sampled estimate's error; learning-rate growth on real schedules and on faults."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rl_guard.stats.accumulate import StepAccumulator
from rl_guard.stats.summarize import summarize
from rl_guard.stats.update import WHOLE, UpdateProbe, stride_for


def _metrics(partial) -> dict:
    acc = StepAccumulator()
    acc.add(partial)
    return summarize(acc.finish())[0]


def _model(seed=0, big=4096):
    torch.manual_seed(seed)
    a = torch.nn.Parameter(torch.randn(big, dtype=torch.float32))
    b = torch.nn.Parameter(torch.randn(7, 3, dtype=torch.float32))
    c = torch.nn.Parameter(torch.randn(5, dtype=torch.float32))
    return [[a, b], [c]]


def _np(groups):
    return [[p.detach().double().numpy().ravel().copy() for p in g] for g in groups]


def test_exact_when_every_element_is_sampled():
    groups = _model()
    opt = torch.optim.SGD([{"params": groups[0]}, {"params": groups[1]}], lr=0.1)
    probe = UpdateProbe(sample=10**6)
    before = _np(groups)
    probe.pre_step(groups, [0.1, 0.1])
    for g in groups:
        for p in g:
            p.grad = torch.randn_like(p)
    opt.step()
    probe.post_step(groups)
    after = _np(groups)
    got = _metrics(probe.pre_step(groups, [0.1, 0.1]))
    d_sq = [sum(((y - x) ** 2).sum() for x, y in zip(bg, ag)) for bg, ag in zip(before, after)]
    base_sq = [sum((x**2).sum() for x in bg) for bg in before]
    assert got["rl_guard/update/rel"] == pytest.approx(math.sqrt(sum(d_sq) / sum(base_sq)), rel=1e-9)
    assert got["rl_guard/update/norm"] == pytest.approx(math.sqrt(sum(d_sq)), rel=1e-9)
    assert got["rl_guard/update/group1/rel"] == pytest.approx(math.sqrt(d_sq[1] / base_sq[1]), rel=1e-9)
    assert got["rl_guard/update/rel_per_lr"] == pytest.approx(got["rl_guard/update/rel"] / 0.1, rel=1e-12)
    now_sq = sum((x**2).sum() for g in after for x in g)
    assert got["rl_guard/update/param_norm"] == pytest.approx(math.sqrt(now_sq), rel=1e-12)
    assert got["rl_guard/update/external_rel"] == 0.0  # nothing touched the weights since the step


@pytest.mark.parametrize("big", [200_000, WHOLE * 1024 + 1])  # a fine stride, and the coarsest one
def test_sampled_estimate_is_within_its_documented_error(big):
    groups = _model(big=big)
    probe = UpdateProbe(sample=1024)
    probe.pre_step(groups, [1.0, 1.0])
    rng = np.random.default_rng(0)
    deltas = []
    with torch.no_grad():
        for g in groups:
            for p in g:
                d = rng.standard_normal(p.numel()) * 1e-3
                deltas.append(d)
                p.add_(torch.from_numpy(d).float().view_as(p))
    probe.post_step(groups)
    got = _metrics(probe.pre_step(groups, [1.0, 1.0]))
    exact = math.sqrt(sum((d.astype(np.float32).astype(np.float64) ** 2).sum() for d in deltas))
    # Gaussian entries: kurtosis 3, so one standard error of the norm is ~sqrt(2/1024)/2 = 2.2 %; allow 4 sigma.
    assert got["rl_guard/update/norm"] == pytest.approx(exact, rel=0.09)
    s = stride_for(big, 1024)
    assert s >= 2 and big % s and all(s % q for q in range(2, s))  # a prime that does not divide numel
    i, offset, stride = next(entry for entry in probe._layout.plan if entry[2] > 1)
    assert (i, stride) == (0, s) and 0 <= offset < s and 1024 <= len(range(offset, big, s)) <= 1.5 * 1024


def test_sample_covers_a_periodic_column_pattern_evenly():
    # An update that moves only every 64th column (e.g. one feature per head): a stride sharing a factor with the
    # row length would see all of those columns or none; a prime stride visits them in proportion.
    rows, cols = 512, 1024
    w = torch.nn.Parameter(torch.zeros(rows, cols))
    groups = [[w]]
    probe = UpdateProbe(sample=1024)
    probe.pre_step(groups, [1.0])
    d = np.zeros((rows, cols))
    d[:, ::64] = np.where(np.random.default_rng(1).random((rows, cols // 64)) < 0.5, -1.0, 1.0)
    with torch.no_grad():
        w.add_(torch.from_numpy(d).float())
    probe.post_step(groups)
    got = _metrics(probe.pre_step(groups, [1.0]))["rl_guard/update/norm"]
    # m >= 1024 samples hold m / 64 +- 1 moved entries: the squared norm within 1/16, the norm within ~3.5 %
    assert got == pytest.approx(math.sqrt((d**2).sum()), rel=0.035)


def test_views_follow_a_parameter_given_new_storage():
    groups = _model(big=50_000)
    probe = UpdateProbe(sample=256)
    probe.pre_step(groups, [0.1, 0.1])
    with torch.no_grad():
        groups[0][0].data = groups[0][0].data * 2  # new storage: views of the old one would see no change
    probe.post_step(groups)
    got = _metrics(probe.pre_step(groups, [0.1, 0.1]))
    assert got["rl_guard/update/rel"] > 0.5
    assert got["rl_guard/update/param_norm"] == pytest.approx(
        math.sqrt(sum(float(p.detach().double().square().sum()) for g in groups for p in g)), rel=1e-12
    )


def test_a_change_outside_the_optimizer_is_seen_and_a_restore_is_not():
    groups = _model()
    probe = UpdateProbe(sample=64)
    probe.pre_step(groups, [0.1, 0.1])
    probe.post_step(groups)
    with torch.no_grad():
        groups[0][0].mul_(1.5)  # e.g. a corrupted weight load between two steps
    got = _metrics(probe.pre_step(groups, [0.1, 0.1]))
    assert got["rl_guard/update/external_rel"] > 0.1
    assert got["rl_guard/update/rel"] == 0.0  # the optimizer itself changed nothing
    probe.post_step(groups)
    with torch.no_grad():
        groups[0][0].div_(1.5)  # a rollback restores the weights on purpose
    probe.resync(groups)
    assert _metrics(probe.pre_step(groups, [0.1, 0.1]))["rl_guard/update/external_rel"] == 0.0


def _growth(lrs, accept=lambda i: True):
    probe, out = UpdateProbe(), []
    for i, lr in enumerate(lrs):
        out.append(probe.lr_metrics([lr]).get("rl_guard/optim/lr_growth"))
        if accept(i):
            probe.accept([lr])
    return out


def test_lr_growth_stays_low_on_schedules_and_flags_jumps_and_ramps():
    warmup = [3e-3 * min(1.0, s / 50) for s in range(200)]  # linear warm-up from 0, then constant
    cosine = [3e-3 * 0.5 * (1 + math.cos(math.pi * (s % 40) / 40)) + 1e-6 for s in range(200)]  # with restarts
    for schedule in (warmup, cosine):
        assert max(g for g in _growth(schedule) if g is not None) <= 4.0
    jump = [1e-3] * 10 + [1e1] + [1e-3] * 5
    assert _growth(jump)[10] == pytest.approx(1e4)
    ramp = [1e-3] * 5 + [1e-3 * 3**k for k in range(1, 8)]
    assert [round(g, 6) for g in _growth(ramp)[5:8]] == [3.0, 9.0, 27.0]
    # A refused rate (not accepted) never becomes the reference: the jump stays visible on the next step too.
    refused = _growth(jump[:12] + [1e1], accept=lambda i: i != 10)
    assert refused[12] == pytest.approx(1e4)


def test_a_parameter_with_no_local_elements_is_left_out():
    groups = _model()
    groups[1].append(torch.nn.Parameter(torch.empty(0)))  # e.g. partitioned away from this rank
    groups.append([])  # and an optimizer group holding nothing on this rank
    probe = UpdateProbe()
    probe.pre_step(groups, [0.1, 0.1, 0.1])
    with torch.no_grad():
        groups[1][0].add_(1.0)
    probe.post_step(groups)
    got = _metrics(probe.pre_step(groups, [0.1, 0.1, 0.1]))
    assert got["rl_guard/update/norm"] == pytest.approx(math.sqrt(5.0), rel=1e-6)
    assert got["rl_guard/update/group2/param_norm"] == 0.0


def test_a_report_survives_the_layout_changing_between_steps():
    # The last step's update is reported at the next pre_step; if the layout changed meanwhile (a new parameter),
    # its figures are not lost.
    groups = _model()
    probe = UpdateProbe(sample=10**6)
    probe.pre_step(groups, [0.1, 0.1])
    before = _np(groups)
    with torch.no_grad():
        groups[1][0].add_(2.0)
    probe.post_step(groups)
    moved = math.sqrt(sum(((y - x) ** 2).sum() for g, h in zip(before, _np(groups)) for x, y in zip(g, h)))
    groups[1].append(torch.nn.Parameter(torch.ones(3)))  # a new layout
    got = _metrics(probe.pre_step(groups, [0.1, 0.1]))
    assert moved == pytest.approx(math.sqrt(20.0), rel=1e-6)
    assert got["rl_guard/update/norm"] == pytest.approx(moved, rel=1e-12)


def _adam_steps(groups, opt, probe, lrs, n=1, seed=0):
    """``n`` optimizer steps framed by the probe as a trainer frames them; the metrics of the next pre_step."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        probe.pre_step(groups, lrs)
        for g in groups:
            for p in g:
                p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        probe.post_step(groups)


@pytest.mark.parametrize("corrupt", ["value", "sign", "bit", "tiny"])
@pytest.mark.parametrize("where", ["large", "whole"])
def test_every_element_is_covered_by_the_integrity_count(corrupt, where):
    """One element changed between two steps, at a position the sample skips (large tensor) or in a tensor taken
    whole: counted, whatever the change, including a sign flip that keeps the norm."""
    groups = _model(big=200_000)
    opt = torch.optim.SGD([{"params": groups[0]}, {"params": groups[1]}], lr=0.1)
    probe = UpdateProbe(sample=1024)
    _adam_steps(groups, opt, probe, [0.1, 0.1])
    target = groups[0][0] if where == "large" else groups[0][1]
    flat = target.detach().view(-1)
    i = 1 if where == "large" else 4
    if where == "large":  # a position outside the strided sample
        s = stride_for(flat.numel(), 1024)
        i = next(k for k in range(1, s) if k % s != probe._layout.plan[-1][1] % s)
    with torch.no_grad():
        if corrupt == "value":
            flat[i] = 1e30
        elif corrupt == "sign":
            flat[i] = -flat[i]
        elif corrupt == "bit":  # the lowest mantissa bit
            flat[i : i + 1].view(torch.int32).bitwise_xor_(1)
        else:
            flat[i] = flat[i] + 1e-7 * abs(float(flat[i]))
    got = _metrics(probe.pre_step(groups, [0.1, 0.1]))
    assert got["rl_guard/update/external_changed"] == 1.0
    if where == "large" and corrupt == "sign":
        assert got["rl_guard/update/external_rel"] == 0.0  # the sample missed it: the fingerprint did not
    if corrupt == "value":
        assert got["rl_guard/update/param_norm_change"] > 1e20


def test_integrity_count_counts_each_changed_tensor_once_in_every_group():
    """Changes in four tensors taken whole, spread over three groups (two in one tensor), and one in a large
    tensor: five tensors changed."""
    torch.manual_seed(0)
    groups = [[torch.randn(100_000), torch.randn(7, 3)], [torch.randn(5)], [torch.randn(3), torch.randn(4, 4)]]
    probe = UpdateProbe(sample=1024)
    probe.pre_step(groups, [0.1] * 3)
    probe.post_step(groups)
    groups[0][0][17] *= -1
    groups[0][1][2, 1] += 1.0
    groups[0][1][0, 0] += 1.0
    groups[1][0][4] = math.nan
    groups[2][0][0] += 1.0
    groups[2][1][3, 3] += 1.0
    assert _metrics(probe.pre_step(groups, [0.1] * 3))["rl_guard/update/external_changed"] == 5.0


def test_integrity_count_is_zero_across_healthy_steps_and_a_restore():
    groups = _model(big=200_000)
    opt = torch.optim.Adam([{"params": groups[0]}, {"params": groups[1]}], lr=1e-3)
    probe = UpdateProbe(sample=1024)
    saved = [[p.detach().clone() for p in g] for g in groups]
    for step in range(4):
        got = _metrics(probe.pre_step(groups, [1e-3, 1e-3]))
        if step:
            assert got["rl_guard/update/external_changed"] == 0.0
        for g in groups:
            for p in g:
                p.grad = torch.randn_like(p)
        opt.step()
        probe.post_step(groups)
    with torch.no_grad():  # a rollback: the weights restored on purpose
        for g, s in zip(groups, saved):
            for p, x in zip(g, s):
                p.copy_(x)
    probe.resync(groups)
    got = _metrics(probe.pre_step(groups, [1e-3, 1e-3]))
    assert got["rl_guard/update/external_changed"] == 0.0
    assert "rl_guard/update/param_norm_change" not in got  # not measured across the restore


def test_integrity_fingerprints_survive_a_checkpoint():
    groups = _model(big=200_000)
    opt = torch.optim.SGD([{"params": groups[0]}, {"params": groups[1]}], lr=0.1)
    probe = UpdateProbe(sample=1024)
    _adam_steps(groups, opt, probe, [0.1, 0.1])
    state = probe.state_dict()
    resumed = UpdateProbe(sample=1024)
    resumed.load_state_dict(state)
    assert _metrics(resumed.pre_step(groups, [0.1, 0.1]))["rl_guard/update/external_changed"] == 0.0
    other = UpdateProbe(sample=1024)
    other.load_state_dict(state)
    with torch.no_grad():
        groups[0][0].view(-1)[7] *= -1  # loaded weights that are not the ones the saving run left
    assert _metrics(other.pre_step(groups, [0.1, 0.1]))["rl_guard/update/external_changed"] == 1.0


def test_rms_per_lr_stays_within_adams_bound_and_flags_a_broken_state():
    groups = _model(big=200_000)
    opt = torch.optim.Adam([{"params": groups[0]}, {"params": groups[1]}], lr=1e-3)
    probe = UpdateProbe(sample=1024)
    _adam_steps(groups, opt, probe, [1e-3, 1e-3])
    first = _metrics(probe.pre_step(groups, [1e-3, 1e-3]))
    # Adam's first step moves every element by lr (m / sqrt(v) = g / |g|), the sampled estimate within a few %
    assert first["rl_guard/update/rms_per_lr"] == pytest.approx(1.0, rel=0.05)
    probe.post_step(groups)  # no step between: nothing pending
    _adam_steps(groups, opt, probe, [1e-3, 1e-3], n=20, seed=1)
    healthy = _metrics(probe.pre_step(groups, [1e-3, 1e-3]))["rl_guard/update/rms_per_lr"]
    assert healthy <= 3.17  # lr (1 - beta1) / sqrt(1 - beta2)
    probe.post_step(groups)
    for state in opt.state.values():  # second moments wiped between steps
        state["exp_avg_sq"].mul_(1e-12)
    _adam_steps(groups, opt, probe, [1e-3, 1e-3], seed=2)
    broken = _metrics(probe.pre_step(groups, [1e-3, 1e-3]))["rl_guard/update/rms_per_lr"]
    assert broken > 20  # the preset's limit is 10
