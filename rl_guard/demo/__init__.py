"""The guarded GRPO demo (``rl-guard demo``): a tiny model built locally, real TRL training, an injected fault."""
