"""Update-size probe: relative update, parameter norm and outside-the-optimizer change against float64 numpy
references; the sampled estimate's error; learning-rate growth on real schedules and on faults."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rl_guard.stats import host_engine
from rl_guard.stats.accumulate import StepAccumulator
from rl_guard.stats.cpu_squares import REL_ERROR
from rl_guard.stats.summarize import summarize
from rl_guard.stats.update import WHOLE, UpdateProbe, stride_for


@pytest.fixture(autouse=True, params=["host", "device"])
def engine(request, monkeypatch):
    """Every test runs both ways: CPU weights read by numpy in place (``host``), and the torch path a GPU's weights
    take (``device``: the host engine off, so CPU tensors are handled as a GPU's)."""
    if request.param == "device":
        monkeypatch.setattr(host_engine, "CPU_MAX_TOKENS", 0)
    return request.param


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
        math.sqrt(sum(float(p.detach().double().square().sum()) for g in groups for p in g)), rel=REL_ERROR / 2)


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


def test_host_and_device_paths_lay_out_and_compute_the_same():
    # Ranks merge packed vectors by layout: whichever path a rank's weights take, the same names in the same order,
    # and the same figures (each path is chosen here, whatever the module's fixture chose).
    reports = {}
    for path in ("host", "device"):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(host_engine, "CPU_MAX_TOKENS", 1 << 13 if path == "host" else 0)
            groups = _model(big=50_000)
            probe = UpdateProbe(sample=256)
            probe.pre_step(groups, [0.1, 0.2])
            with torch.no_grad():
                groups[0][1].add_(0.5)
                groups[1][0].mul_(0.9)
            probe.post_step(groups)
            reports[path] = probe.pre_step(groups, [0.1, 0.2])
            assert probe._layout.host == (path == "host")
    host, device = reports["host"], reports["device"]
    assert host.packed[0] == device.packed[0]
    np.testing.assert_allclose(host.packed[1].numpy(), device.packed[1].numpy(), rtol=1e-12)
    np.testing.assert_allclose(host.packed[2].numpy(), device.packed[2].numpy(), rtol=1e-12)


@pytest.mark.parametrize("first", ["host", "device"])
def test_a_report_survives_the_weights_changing_path_between_steps(first):
    # The last step's update is reported at the next pre_step; if the layout changed path meanwhile (a new
    # parameter, weights moved), its figures are converted, not lost.
    groups = _model()
    probe = UpdateProbe(sample=10**6)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(host_engine, "CPU_MAX_TOKENS", 1 << 13 if first == "host" else 0)
        probe.pre_step(groups, [0.1, 0.1])
        before = _np(groups)
        with torch.no_grad():
            groups[1][0].add_(2.0)
        probe.post_step(groups)
        moved = math.sqrt(sum(((y - x) ** 2).sum() for g, h in zip(before, _np(groups)) for x, y in zip(g, h)))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(host_engine, "CPU_MAX_TOKENS", 0 if first == "host" else 1 << 13)
        groups[1].append(torch.nn.Parameter(torch.ones(3)))  # a new layout, on the other path
        got = _metrics(probe.pre_step(groups, [0.1, 0.1]))
    assert probe._layout.host == (first == "device")
    assert moved == pytest.approx(math.sqrt(20.0), rel=1e-6)
    assert got["rl_guard/update/norm"] == pytest.approx(moved, rel=1e-12)
