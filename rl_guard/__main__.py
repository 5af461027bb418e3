"""``python -m rl_guard ...`` is the ``rl-guard`` command."""

from .cli import main

raise SystemExit(main())
