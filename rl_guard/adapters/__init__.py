"""Thin translations from training frameworks to the framework-agnostic ``Guard``; each imports its framework lazily."""

# The guard's settings in the environment of framework workers (Ray actors, launcher processes) that build their own
# guard: a YAML path or preset name, and the run directory.
CONFIG_ENV, RUN_DIR_ENV = "RL_GUARD_CONFIG", "RL_GUARD_RUN_DIR"
