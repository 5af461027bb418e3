"""The control loop: YAML config -> rules -> controller (a ``Decision`` per step) -> actions on the training state.

``yaml_nodes`` and ``config`` load and validate the YAML (every error located); ``rules`` are pure verdicts;
``controller`` applies warm-up, patience, cooldown and precedence; ``actions`` skip, halt, checkpoint and roll
back through ``state`` (the training-state protocol) and ``checkpoint`` (atomic files and the snapshot ring).
"""
