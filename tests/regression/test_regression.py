"""Seed regression checks: each passes on a correct implementation and fails on a realistic bug."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from rl_guard.regression import (
    RegressionCheckFailed,
    check_advantage_fn_baseline_invariance,
    check_baseline_invariance,
    check_bootstrap_contract,
    check_empty_mask_raises,
    check_group_advantage_zero_on_ties,
    check_ratio_is_one,
    check_zero_advantage_zero_grad,
    expected_policy_gradient,
    reference_returns,
    run_all,
)


class TinyPolicy(nn.Module):
    def __init__(self, vocab=11, dim=8):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.drop, self.head = nn.Embedding(vocab, dim), nn.Dropout(0.3), nn.Linear(dim, vocab)
        self.baseline = nn.Parameter(torch.tensor(0.5))  # learned baseline, only used by a buggy loss

    def forward(self, ids, temperature=1.0):
        return torch.log_softmax(self.head(self.drop(self.emb(ids))) / temperature, dim=-1)


def token_logp(model, batch, temperature=1.0):
    return model(batch["input_ids"], temperature).gather(-1, batch["actions"].unsqueeze(-1)).squeeze(-1)


@pytest.fixture
def model_batch():
    model = TinyPolicy().eval()
    g = torch.Generator().manual_seed(1)
    ids, actions = torch.randint(0, 11, (3, 6), generator=g), torch.randint(0, 11, (3, 6), generator=g)
    mask = torch.ones(3, 6)
    mask[0, 4:] = 0
    mask[2, 5:] = 0
    adv = torch.randn(3, 1, generator=g, dtype=torch.float64).float().expand(3, 6).clone()
    batch = dict(input_ids=ids, actions=actions, mask=mask, advantages=adv)
    with torch.no_grad():
        batch["old_logp"] = token_logp(model, batch)
    return model, batch


def pg_loss(model, batch, eps=0.2, adv_transform=lambda a, m: a):
    """PPO clipped policy-gradient term, token mean over the mask."""
    ratio = torch.exp(token_logp(model, batch) - batch["old_logp"])
    a = adv_transform(batch["advantages"], model)
    per_tok = -torch.min(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a)
    return (per_tok * batch["mask"]).sum() / batch["mask"].sum()


# ---- 1. ratio == 1 ----------------------------------------------------------------------------
def test_ratio_is_exactly_one_in_eval_mode(model_batch):
    model, batch = model_batch
    res = check_ratio_is_one(lambda b: token_logp(model, b), batch, mask=batch["mask"])
    assert res.value == 0.0 and res.metric == "max_abs_ratio_minus_one"


def test_ratio_fails_with_dropout_on(model_batch):
    model, batch = model_batch
    model.train()
    with pytest.raises(RegressionCheckFailed, match=r"max \|r - 1\|"):
        check_ratio_is_one(lambda b: token_logp(model, b), batch, mask=batch["mask"])


def test_ratio_fails_when_train_path_applies_temperature_and_rollout_does_not(model_batch):
    model, batch = model_batch
    with pytest.raises(RegressionCheckFailed, match="ratio_is_one"):
        check_ratio_is_one(
            lambda b: token_logp(model, b, 0.7),
            batch,
            old_logprob_fn=lambda b: token_logp(model, b, 1.0),
            mask=batch["mask"],
        )


def test_ratio_ignores_padding_garbage_only_under_the_mask(model_batch):
    model, batch = model_batch
    # A rollout engine that reports logp = 0 on padding: harmless only if padding is masked out.
    old = lambda b: token_logp(model, b).masked_fill(b["mask"] == 0, 0.0)  # noqa: E731
    new = lambda b: token_logp(model, b)  # noqa: E731
    assert check_ratio_is_one(new, batch, old_logprob_fn=old, mask=batch["mask"]).value == 0.0
    with pytest.raises(RegressionCheckFailed, match="3/18 unmasked tokens"):
        check_ratio_is_one(new, batch, old_logprob_fn=old)


# ---- 2. zero advantages -> zero policy gradient ---------------------------------------------------
def test_zero_advantage_gives_exactly_zero_pg_gradient(model_batch):
    model, batch = model_batch
    res = check_zero_advantage_zero_grad(lambda b: pg_loss(model, b), model.named_parameters(), batch)
    assert res.value == 0.0


def test_full_loss_with_entropy_bonus_is_not_a_pg_only_loss(model_batch):
    # Documented: the check covers the policy-gradient term; an entropy bonus has its own gradient.
    model, batch = model_batch

    def full_loss(b):
        lp = model(b["input_ids"])
        ent = -(lp.exp() * lp).sum(-1)
        return pg_loss(model, b) - 0.01 * (ent * b["mask"]).sum() / b["mask"].sum()

    with pytest.raises(RegressionCheckFailed, match="nonzero gradient"):
        check_zero_advantage_zero_grad(full_loss, model.parameters(), batch)


def test_non_detached_learned_baseline_in_loss_fails(model_batch):
    model, batch = model_batch
    buggy = lambda b: pg_loss(model, b, adv_transform=lambda a, m: a - m.baseline)  # noqa: E731
    with pytest.raises(RegressionCheckFailed, match=r"max \|g\| = .* \(worst parameter"):
        check_zero_advantage_zero_grad(buggy, model.named_parameters(), batch)
    fixed = lambda b: pg_loss(model, b, adv_transform=lambda a, m: a)  # noqa: E731
    assert check_zero_advantage_zero_grad(fixed, model.named_parameters(), batch).value == 0.0


def test_whitening_without_eps_gives_nan_gradient(model_batch):
    model, batch = model_batch
    buggy = lambda b: pg_loss(model, b, adv_transform=lambda a, m: (a - a.mean()) / a.std())  # noqa: E731
    with pytest.raises(RegressionCheckFailed, match="non-finite gradient"):
        check_zero_advantage_zero_grad(buggy, model.parameters(), batch)


def test_detached_loss_is_reported_as_vacuous(model_batch):
    model, batch = model_batch
    with pytest.raises(RegressionCheckFailed, match="vacuous"):
        check_zero_advantage_zero_grad(lambda b: pg_loss(model, b).detach(), model.parameters(), batch)


# ---- 3. baseline invariance by exact enumeration ------------------------------------------------
def test_expected_policy_gradient_matches_closed_form():
    rng = np.random.default_rng(0)
    logits, adv = rng.normal(size=(3, 5)), rng.normal(size=(3, 5))
    pi = np.exp(logits - logits.max(1, keepdims=True))
    pi /= pi.sum(1, keepdims=True)
    # d/dz_k sum_a pi_a A_a log pi_a (A, pi fixed) = pi_k (A_k - sum_j pi_j A_j)
    ref = pi * (adv - (pi * adv).sum(1, keepdims=True))
    np.testing.assert_allclose(expected_policy_gradient(logits, adv).numpy(), ref, rtol=1e-13, atol=1e-15)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_constant_or_per_state_baseline_never_changes_expected_gradient(data):
    s, k = data.draw(st.integers(1, 3)), data.draw(st.integers(2, 6))
    grid = lambda lo, hi, n: st.lists(st.floats(lo, hi), min_size=n, max_size=n)  # noqa: E731
    logits = np.array(data.draw(grid(-6, 6, s * k))).reshape(s, k)
    rewards = np.array(data.draw(grid(-10, 10, s * k))).reshape(s, k)
    baseline = data.draw(st.one_of(st.floats(-100, 100), grid(-100, 100, s)))
    assert check_baseline_invariance(logits, rewards, baseline).value <= 1e-12


def test_action_dependent_baseline_breaks_invariance():
    logits, rewards = torch.tensor([0.0, 1.0, -1.0]), lambda s, a: [1.0, 2.0, 3.0][a]
    assert check_baseline_invariance(logits, rewards, 5.0).value <= 1e-12
    with pytest.raises(RegressionCheckFailed, match="relative .* > rtol 1e-12"):
        check_baseline_invariance(logits, rewards, torch.tensor([0.0, 5.0, 0.0]))


def test_user_advantage_fn_baseline_invariance():
    assert check_advantage_fn_baseline_invariance(lambda r, b: r - b.reshape(-1, 1)).value <= 1e-12
    # Per-state baseline broadcast along the action axis (S == K, so no shape error) is caught.
    with pytest.raises(RegressionCheckFailed, match="must not depend on the action"):
        check_advantage_fn_baseline_invariance(lambda r, b: r - b)
    # Clipping after subtracting the baseline changes which actions get clipped.
    with pytest.raises(RegressionCheckFailed, match="advantage_fn_baseline_invariance"):
        check_advantage_fn_baseline_invariance(lambda r, b: (r - b.reshape(-1, 1)).clamp(-1.0, 1.0))


# ---- 4. bootstrap on truncation, not on termination ---------------------------------------------
def gae_lambda1_numpy(r, v, term, trunc, gamma):
    """Independent reference: GAE(lambda=1) advantages + V, float64 numpy."""
    adv, nxt = np.zeros(len(r)), 0.0
    for t in reversed(range(len(r))):
        delta = r[t] + gamma * v[t + 1] * (1.0 - term[t]) - v[t]
        cut = term[t] or trunc[t]
        nxt = delta + (0.0 if cut else gamma * nxt)
        adv[t] = nxt
    return adv + v[:-1]


def test_reference_returns_pass_and_match_independent_gae():
    assert check_bootstrap_contract(reference_returns).value == 0.0
    rng = np.random.default_rng(3)
    for _ in range(20):
        n = int(rng.integers(1, 9))
        r, v = rng.normal(size=n), rng.normal(size=n + 1)
        term, trunc = rng.random(n) < 0.2, rng.random(n) < 0.2
        got = reference_returns(r, v, term, trunc, 0.93).numpy()
        np.testing.assert_allclose(got, gae_lambda1_numpy(r, v, term, trunc, 0.93), rtol=1e-12, atol=1e-12)


def returns_stopping_at(done):
    """Backward recursion that stops (no bootstrap) wherever done(term, trunc, t) holds."""

    def fn(r, v, term, trunc, gamma):
        out = torch.zeros_like(r)
        for t in reversed(range(len(r))):
            nxt = 0.0 if done(term, trunc, t) else (v[t + 1] if t == len(r) - 1 else out[t + 1])
            out[t] = r[t] + gamma * nxt
        return out

    return fn


@pytest.mark.parametrize(
    "done, pattern",
    [
        (lambda te, tr, t: te[t] or tr[t], r"truncated last step must bootstrap.*got \[3.0, 4.0, 4.0\]"),
        (lambda te, tr, t: False, "terminal last step must not bootstrap"),
        (lambda te, tr, t: te[t], "truncated mid-segment"),  # flows the next episode's return back
    ],
    ids=["truncated_as_terminal", "always_bootstrap", "leak_across_truncation"],
)
def test_buggy_returns_fail_bootstrap_contract(done, pattern):
    with pytest.raises(RegressionCheckFailed, match=pattern):
        check_bootstrap_contract(returns_stopping_at(done))


# ---- 5. GRPO group advantages on ties ------------------------------------------------------------
def grpo(r, g, eps=1e-6):
    x = r.view(-1, g)
    return ((x - x.mean(1, keepdim=True)) / (x.std(1, keepdim=True) + eps)).reshape(-1)


def rloo(r, g):
    x = r.view(-1, g)
    return (x - (x.sum(1, keepdim=True) - x) / (g - 1)).reshape(-1)


@pytest.mark.parametrize(
    "fn", [grpo, rloo, lambda r, g: (r.view(-1, g) - r.view(-1, g).mean(1, keepdim=True)).reshape(-1)]
)
def test_correct_group_advantages_pass(fn):
    assert check_group_advantage_zero_on_ties(fn).value <= 1e-6


def test_std_without_eps_gives_nan_on_ties():
    with pytest.raises(RegressionCheckFailed, match=r"rewards = 0.0 .*non-finite"):
        check_group_advantage_zero_on_ties(lambda r, g: grpo(r, g, eps=0.0))


def test_guarding_only_exact_zero_std_amplifies_rounding_noise():
    def guarded(r, g):  # per-group loop; std of a 1-D tie can be ~1e-17 rather than exactly 0
        out = torch.zeros_like(r)
        for i in range(0, len(r), g):
            x = r[i : i + g]
            s = x.std()
            out[i : i + g] = (x - x.mean()) / s if s > 0 else 0.0
        return out

    with pytest.raises(RegressionCheckFailed, match=r"group_size=3, 3 tied rewards = 0.1 .*nonzero advantages"):
        check_group_advantage_zero_on_ties(guarded)


@pytest.mark.parametrize("fn", [lambda r, g: torch.zeros_like(r), lambda r, g: -grpo(r, g)])
def test_trivial_or_sign_flipped_advantages_fail_control(fn):
    with pytest.raises(RegressionCheckFailed, match="strictly increasing"):
        check_group_advantage_zero_on_ties(fn)


# ---- 6. empty mask --------------------------------------------------------------------------------
VALUES = torch.arange(10.0).reshape(2, 5)


def strict_masked_mean(m):
    if not m.any():
        raise ValueError("empty action mask: no tokens to average")
    return (VALUES * m).sum() / m.sum()


@pytest.mark.parametrize(
    "fn, pattern",
    [
        (lambda m: (VALUES * m).sum() / m.sum(), "NaN"),
        (lambda m: (VALUES * m).sum() / m.sum().clamp(min=1), "silent zero"),
        (lambda m: float((VALUES * m).sum()) / int(m.sum()), "ZeroDivisionError.*accidental"),
        (lambda m: (_ for _ in ()).throw(ValueError("bad input")), "without mentioning the mask"),
    ],
)
def test_empty_mask_must_raise_clear_value_error(fn, pattern):
    assert check_empty_mask_raises(strict_masked_mean).value == 1.0
    with pytest.raises(RegressionCheckFailed, match=pattern):
        check_empty_mask_raises(fn)


# ---- run_all ----------------------------------------------------------------------------------------
def test_run_all_reports_passes_failures_errors_and_skips(model_batch):
    model, batch = model_batch
    good = run_all(
        logprob_fn=lambda b: token_logp(model, b),
        ratio_batch=batch,
        ratio_mask=batch["mask"],
        loss_fn=lambda b: pg_loss(model, b),
        params=model.parameters(),
        loss_batch=batch,
        baseline_advantage_fn=lambda r, b: r - b.reshape(-1, 1),
        returns_fn=reference_returns,
        group_advantage_fn=grpo,
        stats_fn=strict_masked_mean,
    )
    assert good["passed"] and good["failed"] == []
    assert {e["status"] for e in good["checks"].values()} == {"passed"} and len(good["checks"]) == 6

    def broken(*_):
        raise RuntimeError("boom")

    kw = dict(group_advantage_fn=lambda r, g: grpo(r, g, eps=0.0), returns_fn=broken, stats_fn=strict_masked_mean)
    bad = run_all(**kw)
    assert not bad["passed"] and bad["failed"] == ["bootstrap_contract", "group_adv_zero_on_ties"]
    assert bad["checks"]["bootstrap_contract"]["status"] == "error"
    assert "non-finite" in bad["checks"]["group_adv_zero_on_ties"]["message"]
    assert bad["checks"]["ratio_is_one"]["status"] == "skipped"
    with pytest.raises(RegressionCheckFailed, match="group_adv_zero_on_ties"):
        run_all(raise_on_failure=True, **kw)
