"""Run-level diagnostics computed on the host once per generation batch (see ``run.py`` and each family module).

Importing the package registers every metric name with ``rl_guard.glossary`` so YAML rules may name them.
"""

from .run import RunDiagnostics
from .samples import SYSTEM_ERRORS, TERMINATIONS, SampleBatch
from .trend import TRIAD_RULE

__all__ = ["RunDiagnostics", "SampleBatch", "TERMINATIONS", "SYSTEM_ERRORS", "TRIAD_RULE"]
