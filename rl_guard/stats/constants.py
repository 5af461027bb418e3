"""Numeric constants of the statistics engine, named once (torch-free, so the config loader can read them)."""

DEFAULT_LAG_EDGES = (0, 1, 2, 3, 5, 9)  # policy-lag buckets 0, 1, 2, 3-4, 5-8, 9+
DEFAULT_CLIP_EPS = 0.2  # PPO clip epsilon when the trainer states none (TRL, OpenRLHF and AReaL default)
EXP_CLAMP = 80.0  # device exp() argument clamp: a finite but huge log-ratio gives a huge finite ratio, not inf
EXP_ARG_MAX = 709.0  # host math.exp() argument cap: exp(709) ~ 8e307 is the largest finite float64 power of e
STATS_ENGINES = ("auto", "eager", "compiled")  # stats_engine: engines.py (auto: compiled on CUDA, else eager)
