"""RunDiagnostics: per generation batch, on the host, SampleBatch -> flat {rl_guard/<family>/<stat>: float}.

Families (each documented in its module): budget, funnel, term, reward, quadrant, group, length/trend, critic;
plus the audit files when ``run_dir`` is set. A family reports only when its inputs are present, and an
undefined statistic is left out rather than NaN (a non-finite value would fire every rule that names it).
Every name is documented in the glossary (``docs.py`` collects the families' ``DOCS``).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from .audit import AuditWriter
from .budget import Budget, spent
from .critic import critic
from .funnel import funnel
from .groups import groups
from .names import PREFIX, Out
from .quadrant import quadrant
from .reward import reward
from .samples import Prepared, SampleBatch
from .termination import termination
from .trend import Trend

STATE_VERSION = 1


class RunDiagnostics:
    """Run-level diagnostics; call ``update`` once per generation batch.

    ``quadrant_threshold``: reward at or above which a sample is "high reward" (None: batch median rule).
    ``window``: updates in the trend fits. Audit files: ``audit_updates_per_file`` updates per file, the newest
    ``audit_max_files`` files kept, written ``audit_flush_every`` updates at a time and on ``flush`` (see
    ``audit.py``). Cumulative budgets, the trend window and the audit
    sampler's RNG state are in ``state_dict`` so they continue across a resume.
    """

    def __init__(
        self,
        run_dir=None,
        audit_k: int = 3,
        audit_max_files: int = 10,
        seed: int = 0,
        *,
        window: int = 20,
        audit_max_chars: int = 2000,
        audit_updates_per_file: int = 20,
        audit_flush_every: int = 10,
        quadrant_threshold: float | None = None,
    ):
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.audit = (
            AuditWriter(
                self.run_dir, audit_k, audit_max_files, audit_max_chars, audit_updates_per_file, audit_flush_every
            )
            if self.run_dir
            else None
        )
        self.quadrant_threshold = quadrant_threshold
        # Private generator: audit sampling must not shift the training run's global RNG streams.
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.budget = Budget()
        self.trend = Trend(window)
        self.batch_has_signal: bool | None = None  # did the latest batch with groups have one with reward spread?
        self.steps_without_signal = 0

    def update(self, samples: SampleBatch, step: int, *, optimizer_updates: int | None = None) -> dict[str, float]:
        """Metrics for this batch (names carry the ``rl_guard/`` prefix; no ``step`` key)."""
        p = Prepared(samples)  # validates every input before any state changes
        this = spent(samples, p, optimizer_updates)
        out = Out()
        funnel(samples, this.get("rollout_tokens"), out)
        termination(p, out)
        reward(p, out)
        cells = quadrant(p, self.quadrant_threshold, out)
        groups(p, out)
        if PREFIX + "group/empty_frac" in out:  # groups given: does one have differing rewards (a GRPO gradient)?
            self.batch_has_signal = out.get(PREFIX + "group/zero_std_frac", 1.0) < 1.0
        critic(p, out)
        self.budget.update(this, out)
        self.trend.update(p, step, out)
        if self.audit is not None and p.n:
            self.audit.write(step, p, cells, self.rng)
        return dict(out)

    @property
    def last_audit_file(self) -> Path | None:
        """The audit file of the latest update (written out first if it is still queued); None without one."""
        return self.flush()

    def flush(self) -> Path | None:
        """Write the queued audit lines now (the guard calls it when a rule fires); returns the latest file."""
        return self.audit.flush() if self.audit is not None else None

    def close(self) -> None:
        """Write the queued audit lines and close the audit file."""
        if self.audit is not None:
            self.audit.close()

    def no_signal_steps(self) -> dict[str, float]:
        """Once per optimizer step: ``group/no_signal_steps``, consecutive steps whose latest generation batch had
        no group with differing rewards (nothing to learn from); nothing until a batch with groups was seen."""
        if self.batch_has_signal is None:
            return {}
        self.steps_without_signal = 0 if self.batch_has_signal else self.steps_without_signal + 1
        return {PREFIX + "group/no_signal_steps": float(self.steps_without_signal)}

    def state_dict(self) -> dict:
        try:  # the queued updates draw their samples first: the saved generator state follows them
            self.flush()
        except OSError as e:  # a side record: a full disk must not fail the checkpoint that carries this state
            warnings.warn(
                f"rl_guard: the queued audit samples could not be written ({e})", RuntimeWarning, stacklevel=2
            )
        return {
            "version": STATE_VERSION,
            "budget": self.budget.state_dict(),
            "trend": self.trend.state_dict(),
            "rng": self.rng.bit_generator.state,
            "signal": [self.batch_has_signal, self.steps_without_signal],
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"RunDiagnostics state version {state.get('version')!r}, expected {STATE_VERSION}")
        self.flush()  # queued updates are written with the generator state they were queued under
        self.budget.load_state_dict(state["budget"])
        self.trend.load_state_dict(state["trend"])
        self.rng.bit_generator.state = state["rng"]
        self.batch_has_signal, self.steps_without_signal = state.get("signal", [None, 0])
