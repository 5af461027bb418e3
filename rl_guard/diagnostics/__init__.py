"""Run-level diagnostics computed on the host once per generation batch (see ``run.py`` and each family module).

Each family documents its metrics in a ``DOCS`` dict; ``docs.py`` collects them for ``rl_guard.glossary``.
"""

from .run import RunDiagnostics
from .samples import SYSTEM_ERRORS, TERMINATIONS, SampleBatch, SampleError
from .trend import TRIAD_RULE

__all__ = ["RunDiagnostics", "SampleBatch", "SampleError", "TERMINATIONS", "SYSTEM_ERRORS", "TRIAD_RULE"]
