"""rl_guard: guardrails for reinforcement-learning training of language models."""

from .batch import BatchError, EmptyMaskError, TokenBatch

__version__ = "0.1.0"
__all__ = ["TokenBatch", "BatchError", "EmptyMaskError", "__version__"]
