"""Update-size probe: how far each optimizer step moved the weights, in every trainer configuration.

Per optimizer step: ``update/rel`` = ||dtheta|| / ||theta|| (global and per parameter group), the parameter norm,
the learning rate per group, ``update/rms_per_lr`` (the step's root mean square per element in units of the
learning rate), ``update/param_norm_change`` and ``update/external_rel`` / ``update/external_changed``: how far, and
in how many tensors, the weights moved *between* two optimizer steps (only the optimizer or a rollback should move
them). No copy of the weights is kept: tensors of up to ``WHOLE x sample`` elements are taken whole, a larger one
contributes a strided sample (``stride_for``) and an exact integer ``fingerprint`` of its memory. The sampling's
error, the fingerprint and Adam's bound on ``rms_per_lr`` are derived in ``docs/statistics.md`` ("The update
probe").

The samples are strided views of the live weights, made again only when a tensor gets new storage or the parameter
set changes. Every figure stays on the device and travels in the step's one
transfer: the update of step t is measured right after ``optimizer.step()`` and reported with step t+1's statistics
(where a rule on it rolls back to a state from before step t).
"""

from __future__ import annotations

import functools
import math
import operator
import random

import torch

from . import keys
from .chunks import ChunkStats
from .grads import Segments, local_shards, squares
from .on_device import device_vector
from .partial import Partial

DEFAULT_SAMPLE = 1024  # elements per large parameter tensor; see the error note above
WHOLE = 4  # tensors of up to WHOLE x sample elements are taken whole: exact, for a copy of a few sample sizes
GROWTH_STEPS = 3  # optim/lr_growth compares with the smallest of this many last applied rates
F64 = torch.float64


def stride_for(n: int, sample: int) -> int | None:
    """The sampling stride of a tensor of ``n`` elements: the largest prime <= n / sample that does not divide
    ``n``; None (take it whole) when there is none, which only happens below ~13 x sample elements (every prime up
    to n / sample would have to divide n)."""
    if n <= WHOLE * sample:
        return None
    for s in range(n // sample, 1, -1):
        if n % s and all(s % q for q in range(2, math.isqrt(s) + 1)):
            return s
    return None


class _Layout:
    """Where every parameter's sampled elements sit in the sample vector, built once per parameter layout
    (``structure``: shapes, dtypes, merge weights and grouping; the sample positions follow from it and the seed).

    Per group, its whole tensors come first, then its sampled ones, so a group is one contiguous span
    ``[lo, hi)`` of the vector and its whole tensors the span ``[lo, mid)``. ``lengths``: every tensor's length in
    the vector (on the device). ``weights``: per sampled element, ``s`` (1 for a whole tensor) times the merge
    weight; None when all are 1."""

    def __init__(self, pairs, structure: tuple, sample: int, seed: int, device):
        self.structure, self.device = structure, device
        self.storage: tuple | None = None
        # plan: per tensor in vector order, (its index in the flattened pairs, offset, stride); stride 1: whole
        self.plan, self.spans, big_counts, elem_w = [], [], [], []  # big_counts: per group, its sampled tensors
        big_w: list[float] = []
        self.count = 0.0  # elements over all tensors, merge weights applied (update/rms_per_lr divides by it)
        pos = first = 0
        for group in pairs:
            indexed = list(enumerate(group, first))
            first += len(group)
            strides = [stride_for(t.numel(), sample) for t, _ in group]
            whole = [(i, t, w) for (i, (t, w)), s in zip(indexed, strides) if s is None]
            sampled = [(i, t, w, s) for (i, (t, w)), s in zip(indexed, strides) if s is not None]
            lo = pos
            self.count += sum(t.numel() * w for t, w in group)
            for i, t, w in whole:
                self.plan.append((i, 0, 1))
                elem_w.append((w, t.numel()))
                pos += t.numel()
            mid = pos
            for i, t, w, s in sampled:
                offset = random.Random(seed * 1_000_003 + len(big_w)).randrange(s)
                self.plan.append((i, offset, s))
                n = len(range(offset, t.numel(), s))
                elem_w.append((w * s, n))
                pos += n
                big_w.append(w)
            big_counts.append(len(sampled))
            self.spans.append((lo, mid, pos))
        self.weights: torch.Tensor | None = None
        if any(w != 1.0 for w, _ in elem_w):
            self.weights = torch.cat([torch.full((n,), w, dtype=F64, device=device) for w, n in elem_w])
        self.lengths = device_vector([n for _, n in elem_w], device, torch.int64)
        taken_whole = [float(s == 1) for _, _, s in self.plan]
        self.whole = device_vector(taken_whole, device) if any(taken_whole) else None
        self.big_segments = Segments(tuple(big_w), tuple(big_counts), device)
        self.views: list[torch.Tensor] = []
        self.big: list[torch.Tensor] = []
        self.count_value = torch.full((), self.count, dtype=F64, device=device)

    def bind(self, pairs, storage: tuple | None) -> None:
        """The sample views of these tensors (same structure): 1-D views that alias the live weights, so they are
        made again only when a tensor moved (``storage``: addresses and strides; None: copies, made every call)."""
        if storage is not None and storage == self.storage:
            return
        tensors = [t for group in pairs for t, _ in group]
        self.views, self.big = [], []
        for i, offset, s in self.plan:
            flat = tensors[i].view(-1) if tensors[i].is_contiguous() else tensors[i].reshape(-1)
            self.views.append(flat if s == 1 else flat[offset::s])
            if s > 1:
                self.big.append(tensors[i])
        self.storage = storage

    def take(self) -> torch.Tensor:
        """The current sampled values, float64 (exact for every floating dtype up to float64): concatenated in the
        weights' dtype, then converted (on CPU a ``cat`` that converts as it copies is several times slower)."""
        if not self.views:
            return torch.zeros(0, dtype=F64, device=self.device)
        return torch.cat(self.views).to(F64)

    def group_sq(self, a, b, whole_only: bool = False) -> list:
        """Per group, the weighted sum of ``(a - b)^2`` (``a^2`` when ``b`` is None) over its whole tensors
        (``whole_only``) or all its samples; 0-d tensors. One dot product per group (an empty one: 0): a NaN in
        one group leaves the others finite."""
        d = a if b is None else a - b
        dw = d if self.weights is None else d * self.weights
        end = 1 if whole_only else 2  # in a span (lo, mid, hi)
        return [torch.dot(dw[span[0] : span[end]], d[span[0] : span[end]]) for span in self.spans]

    def total_sq(self, a, b):
        """The weighted sum of ``(a - b)^2`` over every sample."""
        d = a - b
        return torch.dot(d if self.weights is None else d * self.weights, d)

    def big_sq(self) -> list | None:
        """Per group, the exact merge-weighted squared norm of its sampled (large) tensors, 0-d like ``group_sq``'s
        (so every rank lays out the same statistics); None when there are none (one multi-tensor norm over all)."""
        if not self.big:
            return None
        return [t.reshape(()) for t in self.big_segments.sums(squares(self.big))[0]]

    def fingerprints(self):
        """Every sampled (large) tensor's ``fingerprint`` (an int64 vector); None when there is no such tensor. Reads
        every element once, as the exact norm does."""
        if not self.big:
            return None
        return torch.stack([fingerprint(t) for t in self.big])

    def changed(self, now, after, fp_now, fp_after):
        """How many tensors changed between the samples ``after`` and ``now`` (same layout): a whole tensor when any
        of its elements differs (every element is in the sample), a large one when its fingerprint differs (every
        element is in the fingerprint). A NaN counts as a change. A 0-d float64 tensor."""
        if self.whole is None:
            n = torch.zeros((), dtype=F64, device=self.device)
        else:  # per tensor, its changed elements (on CPU "sum" is 4x faster than "max"), counted for the whole ones
            per_tensor = torch.segment_reduce((now != after).to(F64), "sum", lengths=self.lengths, unsafe=True)
            n = torch.dot((per_tensor > 0).to(F64), self.whole)
        if fp_now is not None and fp_after is not None:
            n = n + (fp_now != fp_after).sum().to(F64)
        return n


_INT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """A 0-d int64 tensor: the sum, modulo 2^64, of the tensor's memory read as 64-bit integers (the bits of
    8 / itemsize consecutive elements per word; a tail or an unaligned tensor element by element, each element's
    bits as an integer). Exact integer arithmetic, so the same bits give the same value in any reduction order
    (on any device, any number of threads), and a change of any one element, of any of its bits (a sign flip, a
    bit flip, a value written over it) changes it: the sum moves by the change of one word, never 0 modulo 2^64.
    Changes that cancel exactly (two elements of the same word position swapped) keep it."""
    flat = t.detach().reshape(-1)
    size = flat.element_size()
    per = 8 // size if size in (1, 2, 4) else 1
    n = flat.numel()
    cut = n - n % per
    total = None
    if cut and size <= 8:
        try:
            total = flat[:cut].view(torch.int64).sum()
        except RuntimeError:  # storage offset not a multiple of a word: element by element
            cut = 0
    if cut < n:
        rest = flat[cut:].view(_INT[size]).sum(dtype=torch.int64)
        total = rest if total is None else total + rest
    return total if total is not None else torch.zeros((), dtype=torch.int64, device=t.device)


def _keys(pairs) -> tuple[tuple, tuple | None]:
    """``(structure, storage)`` of the tensors: what the sample positions depend on (shapes, dtypes, weights,
    grouping), and what the cached views depend on (addresses and strides; None when a tensor is not contiguous:
    its flat view is a copy, made again every call)."""
    structure = tuple(tuple((t.shape, t.dtype, w) for t, w in group) for group in pairs)
    storage: tuple | None = tuple((t.data_ptr(), t.stride()) for group in pairs for t, _ in group)
    if not all(t.is_contiguous() for group in pairs for t, _ in group):
        storage = None
    return structure, storage


class UpdateProbe:
    """Call ``pre_step`` right before ``optimizer.step()`` (it returns the ``Partial`` to add to that step's
    statistics), ``post_step`` right after it, and ``resync`` after the weights were restored (a rollback)."""

    def __init__(self, sample: int = DEFAULT_SAMPLE, seed: int = 0, sharded: bool | None = None):
        self.sample, self.seed, self.sharded = sample, seed, sharded
        self._layout: _Layout | None = None
        self._seen: tuple | None = None  # the tensors (and addresses) the layout's views were made from
        self._before: torch.Tensor | None = None  # sampled weights (float64) right before the last optimizer step
        self._after: torch.Tensor | None = None  # sampled weights right after it
        self._after_layout: _Layout | None = None  # the layout ``_after`` was taken with
        self._after_fp = None  # the large tensors' fingerprints right after it (``_Layout.fingerprints``)
        self._prev_sq = None  # exact ||theta||^2 at the last pre_step, with the layout it was measured with
        self._prev_layout: _Layout | None = None
        self._base_sq: list | None = None  # exact ||theta_g||^2 before the last step, then the total
        self._pending: ChunkStats | None = None  # the last step's update, reported at the next pre_step
        self._lr_max: list[float] = []  # largest applied learning rate so far, per group
        self._lr_recent: list[list[float]] = []  # the last GROWTH_STEPS applied rates, per group
        self._last_lrs: list[float] = []
        self._merge_sum = bool(sharded)  # ranks hold shards (FSDP2 DTensors, or sharded: true): merge by sum
        self._restored: tuple | None = None  # (layout structure, sample) loaded from a checkpoint, adopted once

    # -- sampling ------------------------------------------------------------------------------------------------
    @staticmethod
    def _device(groups):
        # Empty groups get their zeros on the parameters' device: stacking a CPU zero with device tensors would fail.
        return next((p.device for group in groups for p in group), None)

    def _take(self, groups) -> torch.Tensor:
        """The sampled weights of every group in one float64 vector (``self._layout`` made current)."""
        # This rank's part of every parameter with its merge weight (``grads.local_shards``: DTensor shards,
        # replicas counted once); callers run under no_grad, so no detach is needed.
        pairs, self._merge_sum = local_shards(groups, self.sharded)
        tensors = [t for group in pairs for t, _ in group]
        seen = self._seen
        # The same tensor objects at the same addresses (every step of a plain run): the views are still valid.
        if (
            seen is None
            or len(seen[0]) != len(tensors)
            or not all(a is b for a, b in zip(seen[0], tensors))
            or seen[1] != [t.data_ptr() for t in tensors]
            or seen[2] != [len(g) for g in pairs]
        ):
            structure, storage = _keys(pairs)
            if self._layout is None or self._layout.structure != structure:
                self._layout = _Layout(pairs, structure, self.sample, self.seed, self._device(groups))
            self._layout.bind(pairs, storage)
            self._seen = (
                None if storage is None else (tensors, [t.data_ptr() for t in tensors], [len(g) for g in pairs])
            )
        assert self._layout is not None  # made above at the first call
        return self._layout.take()

    def _param_sq(self, now) -> list:
        """Exact ||theta_g||^2 per group (merge weights applied): whole tensors from their copy in ``now``, the
        larger ones from one multi-tensor norm."""
        layout = self._layout
        assert layout is not None  # ``_take`` made it
        sq = layout.group_sq(now, None, whole_only=True)
        big = layout.big_sq()
        return sq if big is None else [a + b for a, b in zip(sq, big)]

    # -- the step ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def pre_step(self, groups: list[list[torch.Tensor]], lrs: list[float]) -> Partial:
        """The last step's update, the weight change since then, the current norms (device, no sync)."""
        now = self._take(groups)  # first: it finds whether the parameters are shards
        layout = self._layout
        if self._restored is not None:
            self._adopt_restored(layout)
        assert layout is not None
        report, self._pending = self._pending or ChunkStats(0, layout.device), None
        add = report.sum if self._merge_sum else report.max
        fp = layout.fingerprints()  # beside the exact norm: every element of the large tensors
        if self._after is not None and self._after_layout is layout:
            add(keys.UPDATE.drift_sq, layout.total_sq(now, self._after))
            add(keys.UPDATE.changed, layout.changed(now, self._after, fp, self._after_fp))
        base = self._param_sq(now)
        base.append(functools.reduce(operator.add, base))  # one add per further group
        for i, sq in enumerate(base[:-1]):
            add(keys.update_group(i, "param_sq"), sq)
        add(keys.UPDATE.param_sq, base[-1])
        if self._prev_sq is not None and self._prev_layout is layout:
            add(keys.UPDATE.prev_param_sq, self._prev_sq)
        self._prev_sq, self._prev_layout = base[-1], layout
        self._base_sq, self._before = base, now
        self._last_lrs = list(lrs)
        return report.partial()

    @torch.no_grad()
    def post_step(self, groups: list[list[torch.Tensor]]) -> None:
        """Measure the update ``optimizer.step()`` just applied (kept on the device until the next pre_step)."""
        if self._before is None:
            return
        layout = self._layout
        assert layout is not None and self._base_sq is not None  # set with ``_before`` by pre_step
        after = self._take(groups)
        report = ChunkStats(0, layout.device)
        add = report.sum if self._merge_sum else report.max
        if self._layout is layout:
            sq = layout.group_sq(after, self._before)
            for i, (s, b) in enumerate(zip(sq, self._base_sq)):
                add(keys.update_group(i, "sq"), s)
                add(keys.update_group(i, "base_sq"), b)
                lr = self._last_lrs[i] if i < len(self._last_lrs) else math.nan
                report.max(keys.update_group(i, "lr"), torch.full((), lr, dtype=F64, device=layout.device))
            add(keys.UPDATE.sq, functools.reduce(operator.add, sq))
            add(keys.UPDATE.base_sq, self._base_sq[-1])
            add(keys.UPDATE.count, layout.count_value)
        self._pending, self._before = report, None
        self._after, self._after_layout = after, self._layout
        self._after_fp = self._layout.fingerprints() if self._layout is not None else None

    @torch.no_grad()
    def resync(self, groups: list[list[torch.Tensor]]) -> None:
        """The weights were restored on purpose: measure later drift from here, and report no update (nor a change
        of the parameter norm across the restore)."""
        self._after, self._pending, self._before = self._take(groups), None, None
        self._after_layout = self._layout
        self._after_fp = self._layout.fingerprints() if self._layout is not None else None
        self._prev_sq = self._prev_layout = None

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
        """The learning-rate history and the weight sample after the last step: a resumed run then measures whether
        the weights it loaded are the ones the saving run left (``update/external_rel`` at the first resumed step)."""
        state: dict = {"lr_max": list(self._lr_max), "lr_recent": [list(r) for r in self._lr_recent]}
        if self._after is not None and self._after_layout is not None:
            state["after"] = self._after.detach().to("cpu", copy=True)
            state["after_structure"] = repr(self._after_layout.structure)
            if self._after_fp is not None:
                state["after_fingerprints"] = self._after_fp.detach().to("cpu", copy=True)
        return state

    def load_state_dict(self, state: dict) -> None:
        self._lr_max = list(state.get("lr_max", []))
        self._lr_recent = [list(r) for r in state.get("lr_recent", [])]
        after = state.get("after")
        self._restored = (
            (state["after_structure"], after, state.get("after_fingerprints")) if after is not None else None
        )

    def _adopt_restored(self, layout) -> None:
        """Take the saved sample as the reference when the parameters have the layout it was taken with."""
        assert self._restored is not None  # the caller checked
        structure, after, fp = self._restored
        self._restored = None
        if self._after is None and repr(layout.structure) == structure:
            self._after = after.to(layout.device)
            self._after_layout = layout
            if fp is not None:
                self._after_fp = fp.to(layout.device)


def learning_rates(optimizer) -> list[float]:
    """Current learning rate per parameter group (host floats; a tensor LR on the host is read without a sync)."""
    return [float(g["lr"]) for g in optimizer.param_groups]
