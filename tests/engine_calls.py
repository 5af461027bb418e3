"""How often the compiled engine's kernels ran: proof that a compiled arm really compiled (no fallback hides)."""

from rl_guard.stats import eager, families


def compiled_calls() -> int:
    """Calls of the compiled engine's kernels so far (a chunk's, a whole micro-batch's): it grows only when the
    compiled engine really ran."""
    return sum(info.hits + info.misses for info in (families._compiled.cache_info(), eager.whole_kernel.cache_info()))
