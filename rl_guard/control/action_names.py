"""The actions a rule can take, as one type.

``Action`` is a ``Literal`` of the very strings the YAML uses, so ``action: rollback`` in a config and
``decision.action == "rollback"`` in a loop compare the same values; ``ACTIONS`` lists them in precedence order
(when several rules fire, the later one wins).
"""

from __future__ import annotations

from typing import Literal, get_args

Action = Literal["warn", "skip_step", "early_stop", "checkpoint_and_halt", "rollback"]
ACTIONS: tuple[Action, ...] = get_args(Action)
