"""rl_guard: guardrails inside RL training of language models.

Device-side health statistics every optimizer step, YAML guardrail rules, and actions taken before
``optimizer.step()`` (warn, skip the step, stop early, checkpoint and halt, roll back).
"""

from .batch import BatchError, EmptyMaskError, TokenBatch
from .config import ConfigError, GuardConfig, load_config
from .controller import Decision
from .guard import Guard

__version__ = "0.1.0"
__all__ = ["Guard", "ConfigError", "TokenBatch", "Decision", "GuardConfig", "load_config", "BatchError",
           "EmptyMaskError", "__version__"]
