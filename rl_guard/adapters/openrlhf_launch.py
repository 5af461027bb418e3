"""Run OpenRLHF's PPO entry point with the guard attached, without editing OpenRLHF.

    python -m rl_guard.adapters.openrlhf_launch --rl_guard.config configs/ppo.yaml [--rl_guard.run_dir DIR] \\
        <every argument of openrlhf.cli.train_ppo_ray, unchanged>

Read against openrlhf 0.11.2 and ray 2.55 (the pins of openrlhf 0.11.2):

- ``openrlhf.cli.train_ppo_ray.train`` calls ``ray.init(runtime_env={"env_vars": ...})`` only when Ray is not
  initialised yet. The launcher initialises Ray first with the same environment variables plus a
  ``worker_process_setup_hook`` (Ray runs it in every worker process before any task or actor) and the guard's
  settings as ``RL_GUARD_*`` variables, then runs ``openrlhf.cli.train_ppo_ray`` as ``__main__`` with the
  remaining arguments. Against a running cluster, ``RAY_ADDRESS`` is honoured by that ``ray.init`` as usual.
- ``PolicyModelActor.init_model_from_pretrained`` (a Ray actor; one per actor rank) loads a checkpoint with
  ``strategy.load_ckpt(self.actor.model, <ckpt.path>/_actor)`` and then builds ``ActorPPOTrainer``. The hook
  wraps ``DeepspeedStrategy.load_ckpt`` (remembers the client states it returned, per engine) and
  ``ActorPPOTrainer.__init__`` (calls ``install`` on the new trainer, then restores the guard's state from the
  checkpoint's ``client_state["rl_guard"]``, which ``install`` adds to every ``save_ckpt`` of the actor).
  Both wraps are class attributes patched in the worker process only; the critic's trainer is not touched. Before
  patching, ``setup_worker`` checks both methods and the parameters read by name (``strategy``, ``actor``;
  ``model``): a missing or re-signed one raises ``SeamError`` in the worker, naming the version and the seam.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys

from ..versions import check_range, require_seam
from . import CONFIG_ENV, RUN_DIR_ENV
from .seams import arguments

OPTIONS = {"--rl_guard.config": CONFIG_ENV, "--rl_guard.run_dir": RUN_DIR_ENV}
HOOK = f"{__name__}.setup_worker"
# The environment OpenRLHF's own ray.init sets (openrlhf/cli/train_ppo_ray.py, 0.11.2), with the same defaults.
OPENRLHF_ENV = {"TOKENIZERS_PARALLELISM": "true", "NCCL_DEBUG": "WARN", "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}


def split_args(argv: list[str]) -> tuple[dict, list[str]]:
    """(the guard's settings as environment variables, OpenRLHF's arguments in their order)."""
    ours, rest, i = {}, [], 0
    while i < len(argv):
        arg = argv[i]
        key, eq, value = arg.partition("=")
        if key in OPTIONS:
            if not eq:
                if i + 1 >= len(argv):
                    raise SystemExit(f"{key} needs a value")
                i, value = i + 1, argv[i + 1]
            ours[OPTIONS[key]] = value
        else:
            rest.append(arg)
        i += 1
    if CONFIG_ENV not in ours:
        raise SystemExit("rl_guard: --rl_guard.config <guard YAML> is required (e.g. configs/ppo.yaml)")
    ours[CONFIG_ENV] = os.path.abspath(ours[CONFIG_ENV])
    if RUN_DIR_ENV in ours:
        ours[RUN_DIR_ENV] = os.path.abspath(ours[RUN_DIR_ENV])
    return ours, rest


def runtime_env(settings: dict) -> dict:
    env = {k: os.environ.get(k, v) for k, v in OPENRLHF_ENV.items()}
    return {"env_vars": {**env, **settings}, "worker_process_setup_hook": HOOK}


_client_states: dict[int, dict] = {}


# the methods patched, with the parameters read by name
PATCHED = {"__init__": ("strategy", "actor"), "load_ckpt": ("model",)}


def _remember_load(original, self, *args, **kwargs):
    path, states = original(self, *args, **kwargs)
    model = arguments(original, (self, *args), kwargs)["model"]
    _client_states[id(getattr(model, "module", model))] = states or {}  # a DeepSpeed engine's module, or the model
    return path, states


def _install_on_init(original, self, *args, **kwargs):
    original(self, *args, **kwargs)
    from ..guard import Guard
    from .openrlhf import _engine, install, load_guard_state

    named = arguments(original, (self, *args), kwargs)
    strategy, actor = named["strategy"], named["actor"]
    run_dir = os.environ.get(RUN_DIR_ENV) or os.path.join(strategy.args.ckpt.path, "rl_guard")
    guard = install(self, Guard.from_yaml(os.environ[CONFIG_ENV], run_dir=run_dir))
    engine = _engine(actor)
    load_guard_state(guard, _client_states.pop(id(getattr(engine, "module", engine)), {}))
    self.rl_guard = guard


def setup_worker() -> None:
    """Ray's ``worker_process_setup_hook``: patch OpenRLHF's classes in this worker (idempotent)."""
    if not os.environ.get(CONFIG_ENV):
        return
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer
    from openrlhf.utils.deepspeed import DeepspeedStrategy

    patches = ((ActorPPOTrainer, "__init__", _install_on_init), (DeepspeedStrategy, "load_ckpt", _remember_load))
    check_classes(ActorPPOTrainer, DeepspeedStrategy)
    for cls, name, wrapper in patches:
        original = getattr(cls, name)
        if getattr(original, "_rl_guard", False):
            continue
        setattr(cls, name, _method(wrapper, original))


def check_classes(trainer_cls, strategy_cls) -> None:
    """The tested openrlhf range and the two methods ``setup_worker`` patches (``SeamError`` names the one)."""
    from .openrlhf import TESTED, _where

    check_range("OpenRLHF", "openrlhf", *TESTED["openrlhf"])
    for cls, name in ((trainer_cls, "__init__"), (strategy_cls, "load_ckpt")):
        require_seam(cls, name, params=PATCHED[name], where=_where())


def _method(wrapper, original):
    @functools.wraps(original)
    def method(self, *args, **kwargs):
        return wrapper(original, self, *args, **kwargs)

    method._rl_guard = True  # type: ignore[attr-defined]  # a marker on the function object
    return method


def main(argv: list[str] | None = None) -> None:
    settings, rest = split_args(list(sys.argv[1:] if argv is None else argv))
    os.environ.update(settings)
    import ray

    if not ray.is_initialized():
        ray.init(runtime_env=runtime_env(settings))
    setup_worker()  # the driver too (a local-mode run builds the trainer in this process)
    sys.argv = ["openrlhf.cli.train_ppo_ray", *rest]
    runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
