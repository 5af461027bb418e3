"""Update-size probe: how far each optimizer step moved the weights, in every trainer configuration.

Unlike the ratio and KL (which need an old or reference policy), the update itself always exists. Per optimizer
step it reports ``update/rel`` = ||dtheta|| / ||theta|| (global and per parameter group), the parameter norm, the
learning rate per group, and ``update/external_rel``: how far the weights moved *between* two optimizer steps
(nothing but the optimizer, or a rollback, should move them; a changed weight there is a bug or a fault).

No full copy of the weights is kept. Each parameter tensor with more than ``sample`` elements contributes a fixed
random subset of ``sample`` element positions (drawn once, with a fixed seed, on the parameter's device); smaller
tensors are taken whole. ``||dtheta_p||^2`` is estimated as ``numel / k x sum over the subset of dtheta^2``
(unbiased under uniform sampling; without replacement up to ``PERMUTE_LIMIT`` elements, with replacement above,
where a permutation would cost gigabytes and k / numel is negligible anyway). The relative standard error of one tensor's squared-norm
estimate is ``sqrt((kurt - 1) / k x (1 - k / numel))`` with ``kurt = E[d^4] / E[d^2]^2`` of the update entries:
Adam-style updates have ``kurt`` ~ 1.5-3, so with the default ``k = 1024`` one tensor's *norm* is within ~2-3 %
(one standard error), and the global norm, a sum over many tensors, closer still. A fault that changes only a
handful of elements of a large tensor can fall outside the subset: the probe is for update *size*, not for
locating single corrupted entries. ``||theta||`` is exact (one fused multi-tensor norm).

All figures stay on the device and travel in the step's one device-to-host transfer: the update of step t is
measured right after ``optimizer.step()`` and reported with step t+1's statistics (where a rule on it rolls back
to a state from before step t). The learning rates are host floats read from the optimizer (no transfer).
"""

from __future__ import annotations

import math

import torch

from . import keys
from .grads import flatten, group_sums, local_shards, weighted_squares
from .partial import Partial

DEFAULT_SAMPLE = 1024  # elements per parameter tensor; see the error note above
PERMUTE_LIMIT = 1 << 22  # elements: above, positions are drawn with replacement (randperm would need 8 B each)
GROWTH_STEPS = 3  # optim/lr_growth compares with the smallest of this many last applied rates


class UpdateProbe:
    """Call ``pre_step`` right before ``optimizer.step()`` (it returns the ``Partial`` to add to that step's
    statistics), ``post_step`` right after it, and ``resync`` after the weights were restored (a rollback)."""

    def __init__(self, sample: int = DEFAULT_SAMPLE, seed: int = 0, sharded: bool | None = None):
        self.sample, self.seed, self.sharded = sample, seed, sharded
        self._index: dict[tuple, torch.Tensor | None] = {}
        self._weights: torch.Tensor | None = None  # numel / k (times the merge weight) per sampled element
        self._spans: tuple[tuple[int, int], ...] = ()   # where each group's samples sit in the sampled vector
        self._before: torch.Tensor | None = None   # sampled weights (float32) right before the last optimizer step
        self._after: torch.Tensor | None = None    # sampled weights right after it
        self._base_sq: list[torch.Tensor] | None = None  # exact ||theta_g||^2 before the last step
        self._pending: Partial | None = None             # the last step's update, reported at the next pre_step
        self._lr_max: list[float] = []                   # largest applied learning rate so far, per group
        self._lr_recent: list[list[float]] = []          # the last GROWTH_STEPS applied rates, per group
        self._last_lrs: list[float] = []
        self._merge_sum = bool(sharded)  # ranks hold shards (FSDP2 DTensors, or sharded: true): merge by sum

    # -- sampling ------------------------------------------------------------------------------------------------
    def _idx(self, key: tuple, p: torch.Tensor) -> torch.Tensor | None:
        if key not in self._index:
            n = p.numel()
            if n <= self.sample:
                self._index[key] = None
            else:
                gen = torch.Generator(device="cpu").manual_seed(self.seed + len(self._index))
                if n <= PERMUTE_LIMIT:
                    idx = torch.randperm(n, generator=gen)[: self.sample]
                else:  # a permutation of a ZeRO flat partition or an embedding would take gigabytes
                    idx = torch.randint(n, (self.sample,), generator=gen)
                self._index[key] = idx.sort().values.to(p.device)
        return self._index[key]

    @staticmethod
    def _device(groups):
        # Empty groups get their zeros on the parameters' device: stacking a CPU zero with device tensors would fail.
        return next((p.device for group in groups for p in group), None)

    def _local(self, groups) -> list[list[tuple[torch.Tensor, float]]]:
        """This rank's part of every parameter with its merge weight (``grads.local_shards``: DTensor shards,
        replicas counted once)."""
        pairs, self._merge_sum = local_shards(groups, self.sharded)  # callers run under no_grad: no detach needed
        return pairs

    def _take(self, groups, pairs=None) -> torch.Tensor:
        """The sampled weights of every group in one float32 vector (``self._spans``: where each group sits)."""
        parts, counts = [], []
        for i, group in enumerate(self._local(groups) if pairs is None else pairs):
            for j, (p, _) in enumerate(group):
                idx = self._idx((i, j, p.numel()), p)
                flat = p.reshape(-1)
                parts.append(flat if idx is None else flat.index_select(0, idx))
            counts.append(len(group))
        device = parts[0].device if parts else self._device(groups)
        # cat copies (whole small tensors are views of the live weights until here) and promotes mixed dtypes
        out = torch.cat(parts).to(torch.float32) if parts else torch.zeros(0, device=device)
        if self._weights is None:  # the layout is fixed for the run: weights and group spans are built once
            pairs = self._local(groups) if pairs is None else pairs
            weight = [(w * p.numel() / part.numel(), part.numel())
                      for (p, w), part in zip((pair for group in pairs for pair in group), parts)]
            self._weights = torch.cat([torch.full((n,), w, dtype=torch.float64, device=device) for w, n in weight]
                                      ) if weight else torch.zeros(0, dtype=torch.float64, device=device)
            spans, start, k = [], 0, 0
            for n in counts:
                size = sum(part.numel() for part in parts[k:k + n])
                spans.append((start, start + size))
                start, k = start + size, k + n
            self._spans = tuple(spans)
        return out

    def _sq(self, a: torch.Tensor, b: torch.Tensor, per_group: bool = True) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Estimated ||a - b||^2 per group (when asked) and over all groups."""
        d = a.double().sub_(b)  # the difference in float64 (float32 would round a small update)
        d.mul_(d)
        w = self._weights
        groups = [torch.dot(d[lo:hi], w[lo:hi]) for lo, hi in self._spans] if per_group else []
        return groups, torch.dot(d, w)

    def _param_sq(self, groups, pairs) -> list[torch.Tensor]:
        """Exact ||theta_g||^2 per group (merge weights applied), one multi-tensor norm over all groups."""
        tensors, weights, spans = flatten(pairs)
        sq = weighted_squares(tensors, weights)[1] if tensors else None
        return group_sums(sq, spans, self._device(groups))

    # -- the step ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def pre_step(self, groups: list[list[torch.Tensor]], lrs: list[float]) -> Partial:
        """The last step's update, the weight change since then, the current norms (device, no sync)."""
        p = self._pending or Partial()
        self._pending = None
        pairs = self._local(groups)  # first: it finds whether the parameters are shards
        now = self._take(groups, pairs)
        add = p.add_sum if self._merge_sum else p.add_max
        if self._after is not None and self._after.shape == now.shape:
            add(keys.UPDATE.drift_sq, self._sq(now, self._after, per_group=False)[1])
        self._base_sq = self._param_sq(groups, pairs)
        for i, sq in enumerate(self._base_sq):
            add(keys.update_group(i, "param_sq"), sq)
        add(keys.UPDATE.param_sq, torch.stack(self._base_sq).sum())
        self._before = now
        self._last_lrs = list(lrs)
        return p

    @torch.no_grad()
    def post_step(self, groups: list[list[torch.Tensor]]) -> None:
        """Measure the update ``optimizer.step()`` just applied (kept on the device until the next pre_step)."""
        if self._before is None:
            return
        after = self._take(groups)
        p = Partial()
        add = p.add_sum if self._merge_sum else p.add_max
        sq, total = self._sq(after, self._before)
        for i, (s, b) in enumerate(zip(sq, self._base_sq)):
            add(keys.update_group(i, "sq"), s)
            add(keys.update_group(i, "base_sq"), b)
            lr = self._last_lrs[i] if i < len(self._last_lrs) else math.nan
            p.add_max(keys.update_group(i, "lr"), torch.full((), lr, dtype=torch.float64, device=s.device))
        add(keys.UPDATE.sq, total)
        add(keys.UPDATE.base_sq, torch.stack(self._base_sq).sum())
        self._pending, self._after, self._before = p, after, None

    @torch.no_grad()
    def resync(self, groups: list[list[torch.Tensor]]) -> None:
        """The weights were restored on purpose: measure later drift from here, and report no update."""
        self._after, self._pending, self._before = self._take(groups), None, None

    # -- learning rates (host floats) ----------------------------------------------------------------------------
    def lr_metrics(self, lrs: list[float]) -> dict[str, float]:
        """``optim/lr`` (largest group), ``optim/group<i>/lr`` (several groups), ``optim/lr_vs_max`` (this rate over
        the largest rate the group applied before) and ``optim/lr_growth``: when a group's rate exceeds every rate it
        applied before, its ratio to the smallest of its last ``GROWTH_STEPS`` applied rates (else 1). A scheduled
        rate climbs only in a warm-up (a linear one from 0 by at most 4x over 3 steps, after its first 3 steps) and
        otherwise stays below its past maximum (decay, restarts), so a large growth is a fault: a jump, or a ramp
        that compounds. Only applied steps count (``accept``): a refused rate never becomes the norm."""
        out = {"rl_guard/optim/lr": max(lrs) if lrs else math.nan}
        if len(lrs) > 1:
            out.update({f"rl_guard/optim/group{i}/lr": lr for i, lr in enumerate(lrs)})
        vs_max, growth = [], []
        for i, lr in enumerate(lrs):
            past = self._lr_recent[i] if i < len(self._lr_recent) else []
            top = self._lr_max[i] if i < len(self._lr_max) else 0.0
            if top > 0:
                vs_max.append(lr / top)
            if past and min(past) > 0:
                growth.append(lr / min(past) if lr > top else 1.0)
        if vs_max:
            out["rl_guard/optim/lr_vs_max"] = max(vs_max)
        if growth:
            out["rl_guard/optim/lr_growth"] = max(growth)
        return out

    def accept(self, lrs: list[float]) -> None:
        """The step with these rates was applied: they join the history ``lr_metrics`` compares against."""
        while len(self._lr_recent) < len(lrs):
            self._lr_recent.append([])
            self._lr_max.append(0.0)
        for i, lr in enumerate(lrs):
            self._lr_recent[i] = (self._lr_recent[i] + [lr])[-GROWTH_STEPS:]
            self._lr_max[i] = max(self._lr_max[i], lr)

    def state_dict(self) -> dict:
        return {"lr_max": list(self._lr_max), "lr_recent": [list(r) for r in self._lr_recent]}

    def load_state_dict(self, state: dict) -> None:
        self._lr_max = list(state.get("lr_max", []))
        self._lr_recent = [list(r) for r in state.get("lr_recent", [])]


def learning_rates(optimizer) -> list[float]:
    """Current learning rate per parameter group (host floats; a tensor LR on the host is read without a sync)."""
    return [float(g["lr"]) for g in optimizer.param_groups]


def summarize_update(raw: dict) -> dict[str, float]:
    """Metrics (names without the ``rl_guard/`` prefix) from the merged update-probe statistics."""
    out: dict[str, float] = {}

    def f(key):
        v = raw.get(key)
        return None if v is None else float(v[0])

    param_sq = f(keys.UPDATE.param_sq)
    if param_sq is not None:
        out["update/param_norm"] = math.sqrt(param_sq)
        drift = f(keys.UPDATE.drift_sq)
        if drift is not None and param_sq > 0:
            out["update/external_rel"] = math.sqrt(drift / param_sq)
    prefix = keys.UPDATE_GROUP_PREFIX
    groups = sorted({int(k[len(prefix):].split(".")[0]) for k in raw if k.startswith(prefix)})
    if len(groups) > 1:
        for g in groups:
            sq = f(keys.update_group(g, "param_sq"))
            if sq is not None:
                out[f"update/group{g}/param_norm"] = math.sqrt(sq)
    sq, base = f(keys.UPDATE.sq), f(keys.UPDATE.base_sq)
    if sq is None or base is None:
        return out
    out["update/norm"] = math.sqrt(sq)
    if base > 0:
        out["update/rel"] = math.sqrt(sq / base)
    lrs = [f(keys.update_group(g, "lr")) for g in groups]
    lr = max((x for x in lrs if x is not None and math.isfinite(x)), default=None)
    if lr and base > 0:
        out["update/rel_per_lr"] = math.sqrt(sq / base) / lr
    if len(groups) > 1:
        for g in groups:
            g_sq, g_base = f(keys.update_group(g, "sq")), f(keys.update_group(g, "base_sq"))
            if g_sq is not None and g_base:
                out[f"update/group{g}/rel"] = math.sqrt(g_sq / g_base)
    return out
