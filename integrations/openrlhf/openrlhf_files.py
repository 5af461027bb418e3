"""OpenRLHF's real ``Experience``, ``PolicyLoss`` and loss normalisers, with or without its full stack.

With OpenRLHF's dependencies installed (deepspeed, pylatexenc, peft, flash_attn, ray, ...) these are plain
imports. After ``pip install --no-deps openrlhf`` on a CPU machine the package ``__init__`` chains pull those in,
so the source files are loaded by path instead, the way OpenRLHF's own tests do (``tests/test_experience.py``,
``tests/test_loss_aggregation.py``): ``trainer/ppo_utils/experience.py`` with the real ``utils/utils.py``
(torch + transformers) registered under the name it imports; ``models/utils.py`` + ``models/loss.py`` in a
private package, with an empty module answering the top-level ``import deepspeed`` of models/utils.py when
deepspeed is absent (PolicyLoss calls nothing from it); ``utils/loss_utils.py`` (torch only).
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from types import SimpleNamespace


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _borrowed(name: str, module):
    """Put ``module`` in ``sys.modules[name]`` only if nothing is there; returns an undo function."""
    if name in sys.modules:
        return lambda: None
    sys.modules[name] = module
    return lambda: sys.modules.pop(name, None)


def load() -> SimpleNamespace:
    """``Experience``, ``split_experience_batch``, ``make_experience_batch``, ``PolicyLoss``,
    ``iter_grad_accum_global_norm``, ``get_loss_batch_info`` and ``root`` (the package directory)."""
    try:
        from openrlhf.models.loss import PolicyLoss
        from openrlhf.trainer.ppo_utils import experience as exp
        from openrlhf.utils import loss_utils
    except ImportError:
        exp = PolicyLoss = loss_utils = None
    spec = importlib.util.find_spec("openrlhf")
    if spec is None:
        raise ImportError("openrlhf is not installed: pip install --no-deps openrlhf==0.11.2")
    root = Path(spec.origin).parent
    if exp is None:
        exp = sys.modules.get("_rlg_openrlhf_experience")
        if exp is None:
            borrowed = "openrlhf.utils.utils" not in sys.modules
            if borrowed:
                _load("openrlhf.utils.utils", root / "utils" / "utils.py")
            try:
                exp = _load("_rlg_openrlhf_experience", root / "trainer" / "ppo_utils" / "experience.py")
            finally:
                if borrowed:  # leave no half-registered openrlhf.utils behind
                    sys.modules.pop("openrlhf.utils.utils", None)
        pkg = sys.modules.get("_rlg_openrlhf_models")
        if pkg is None:
            pkg = types.ModuleType("_rlg_openrlhf_models")
            pkg.__path__ = [str(root / "models")]
            sys.modules[pkg.__name__] = pkg
            undo = lambda: None  # noqa: E731
            if importlib.util.find_spec("deepspeed") is None:
                undo = _borrowed("deepspeed", types.ModuleType("deepspeed"))
            try:
                _load("_rlg_openrlhf_models.utils", root / "models" / "utils.py")
                _load("_rlg_openrlhf_models.loss", root / "models" / "loss.py")
            finally:
                undo()
        PolicyLoss = sys.modules["_rlg_openrlhf_models.loss"].PolicyLoss
        loss_utils = sys.modules.get("_rlg_openrlhf_loss_utils") or _load(
            "_rlg_openrlhf_loss_utils", root / "utils" / "loss_utils.py"
        )
    return SimpleNamespace(
        Experience=exp.Experience,
        split_experience_batch=exp.split_experience_batch,
        make_experience_batch=exp.make_experience_batch,
        PolicyLoss=PolicyLoss,
        iter_grad_accum_global_norm=loss_utils.iter_grad_accum_global_norm,
        get_loss_batch_info=loss_utils.get_loss_batch_info,
        root=root,
    )
