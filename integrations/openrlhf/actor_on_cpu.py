"""OpenRLHF 0.11.2's own actor path on CPU, guarded through the launcher's hook (recipe and test worker).

Usage (environment: the nox session openrlhf, .nox/openrlhf; a model from rl_guard.demo.tiny):
    torchrun --nproc-per-node 2 integrations/openrlhf/actor_on_cpu.py <model dir> <out dir> train
    torchrun --nproc-per-node 2 integrations/openrlhf/actor_on_cpu.py <model dir> <out dir> resume
    torchrun --nproc-per-node 2 integrations/openrlhf/actor_on_cpu.py <model dir> <out dir> rollback_twice
Prints one JSON line per rank (tests/adapters/openrlhf/ runs it with one and two processes). ``rollback_twice``: a
snapshot after every healthy step, ``confirm_steps: 2``, two broken rollout batches: both rollbacks restore the same
snapshot through ``strategy.load_ckpt`` while OpenRLHF's own ``save_ckpt`` rotation runs on the snapshot tags.

What is real: the arguments come from ``openrlhf.cli.train_ppo_ray``'s own parser (run as ``__main__`` up to
``get_strategy``); ``DeepspeedStrategy`` (ZeRO-2, bf16, deepspeed 0.19.6 on its CPU accelerator);
``PolicyModelActor.init_model_from_pretrained`` (the Ray actor's class body, called in this process): ``Actor``,
``strategy.prepare``, ``strategy.load_ckpt`` on resume, ``ActorPPOTrainer``; ``fit`` -> ``ppo_train`` ->
``training_step`` -> ``PolicyLoss`` -> ``strategy.backward`` / ``optimizer_step``; ``save_checkpoint`` ->
``strategy.save_ckpt``. The guard is installed by ``rl_guard.adapters.openrlhf_launch.setup_worker``, the hook Ray
runs in every worker process of a launched job.

Patches, all of hard-coded CUDA calls OpenRLHF makes on paths that are device-neutral otherwise (CPU torch raises
on them):
- ``torch.cuda.set_device`` (``setup_distributed``) and ``torch.cuda.synchronize`` (``fit``,
  ``torch_dist_barrier_and_cuda_sync``): no-ops.
- ``torch.cuda.current_device`` (``ppo_train``, ``forward``, ``all_reduce``): returns ``"cpu"`` (the tensors go
  where CPU training keeps them).
- ``init_device_mesh("cuda", ...)`` in ``openrlhf.utils.deepspeed.deepspeed``: the same mesh on ``"cpu"``.
- ``NaiveReplayBuffer.target_device`` (``torch.device(f"cuda:{current_device()}")``): ``cpu``.
- ``vllm`` (not a dependency of openrlhf, a GPU inference engine): ``openrlhf.trainer.ray`` imports it at module
  level; with ``vllm_engines=None`` and a non-NCCL sync backend the actor never uses it. When it is not installed,
  ``vllm``, ``vllm.inputs`` and ``vllm.utils`` are stubs whose attributes raise if called.
- ``flash_attn`` (a CUDA build, pinned at 2.8.3): ``openrlhf/models/ring_attn_utils.py`` imports
  ``flash_attn.bert_padding`` and ``flash_attn.utils.distributed`` at module level, used only with
  ``--ds.packing_samples`` (ring attention). When flash_attn is not installed, those two modules are registered as
  stubs whose functions raise if called, so the run proves they are unused.
The process group is gloo, started here before ``deepspeed.init_distributed`` (which then reuses it).
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import sys
import types

MODEL, OUT, PHASE = sys.argv[1], sys.argv[2], sys.argv[3]
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
os.environ.update(
    LOCAL_RANK="0",
    DS_ACCELERATOR="cpu",
    OMP_NUM_THREADS="1",
    RL_GUARD_CONFIG=os.path.join(OUT, "guard.yaml"),
    RL_GUARD_RUN_DIR=os.path.join(OUT, "guard"),
)
GUARD = """version: 1
sinks: [jsonl]
snapshots: {healthy_steps: 1, every: 2, keep: 2, where: memory}
rules:
  - {name: rollout_far, metric: rl_guard/behave_imp_weight/min, op: '<', threshold: 0.2, action: skip_step}
  - {name: rollout_broken, metric: rl_guard/behave_imp_weight/min, op: '<', threshold: 0.01, action: rollback}
"""
if PHASE == "rollback_twice":
    GUARD = GUARD.replace("every: 2, keep: 2", "every: 1, keep: 3") + "rollback: {confirm_steps: 2}\n"
if RANK == 0 and PHASE in ("train", "rollback_twice"):
    os.makedirs(OUT, exist_ok=True)
    with open(os.environ["RL_GUARD_CONFIG"], "w") as f:
        f.write(GUARD)

import torch  # noqa: E402

torch.set_num_threads(1)
PATCHED = []


def _no_cuda(name):
    PATCHED.append(name)


def module(name, package=False):
    import importlib.machinery

    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        mod.__path__ = []
    return mod


def unused(name):
    def call(*a, **k):
        raise AssertionError(f"{name} called: the CPU path was expected not to use it")

    return call


def _stub_attr(module_name, attr):
    if attr.startswith("__"):
        raise AttributeError(attr)
    return unused(f"{module_name}.{attr}")


def patch_cuda_calls() -> None:
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    _no_cuda("torch.cuda.set_device/synchronize/current_device")
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        # transformers sees a module without distribution metadata, i.e. no usable flash-attn
        pkg, utils = module("flash_attn", True), module("flash_attn.utils", True)
        bert = module("flash_attn.bert_padding")
        for n in ("index_first_axis", "pad_input", "rearrange", "unpad_input"):
            setattr(bert, n, unused(n))
        dist_mod = module("flash_attn.utils.distributed")
        dist_mod.all_gather = unused("utils.distributed.all_gather")
        sys.modules.update(
            {
                "flash_attn": pkg,
                "flash_attn.utils": utils,
                "flash_attn.bert_padding": bert,
                "flash_attn.utils.distributed": dist_mod,
            }
        )
        _no_cuda("flash_attn stubs")
    try:
        import vllm  # noqa: F401
    except ImportError:
        for name in ("vllm", "vllm.inputs", "vllm.utils"):
            mod = module(name, package=name == "vllm")
            mod.__getattr__ = functools.partial(_stub_attr, name)
            sys.modules[name] = mod
        _no_cuda("vllm stubs")
    import openrlhf.utils.deepspeed.deepspeed as ds_module

    real_mesh = ds_module.init_device_mesh
    ds_module.init_device_mesh = lambda device, *a, **k: real_mesh("cpu", *a, **k)
    _no_cuda("init_device_mesh cuda->cpu")
    from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer

    real_buffer_init = NaiveReplayBuffer.__init__

    def buffer_init(self, *args, **kwargs):  # target_device = torch.device(f"cuda:{current_device()}")
        current, torch.cuda.current_device = torch.cuda.current_device, lambda: 0
        try:
            real_buffer_init(self, *args, **kwargs)
        finally:
            torch.cuda.current_device = current
        self.target_device = torch.device("cpu")

    NaiveReplayBuffer.__init__ = buffer_init
    _no_cuda("NaiveReplayBuffer.target_device cuda:N->cpu")


def openrlhf_args(extra: list[str]):
    """The namespace ``openrlhf.cli.train_ppo_ray`` builds from its own parser and checks."""
    import openrlhf.utils
    import ray

    class Parsed(Exception):
        pass

    captured = {}

    def capture(args):
        captured["args"] = args
        raise Parsed

    real_get, real_init = openrlhf.utils.get_strategy, ray.is_initialized
    openrlhf.utils.get_strategy, ray.is_initialized = capture, lambda: True  # stop before Ray starts anything
    argv = sys.argv
    sys.argv = ["train_ppo_ray", *extra]
    try:
        runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__")
    except Parsed:
        pass
    finally:
        sys.argv, openrlhf.utils.get_strategy, ray.is_initialized = argv, real_get, real_init
    return captured["args"]


def weights(engine):
    return [p.detach().clone() for p in engine.module.parameters()]  # ZeRO-2: every rank holds full parameters


def master_norm(engine) -> float:
    """||theta|| over every rank's fp32 master partition (ZeRO-2), float64: the reference for update/param_norm."""
    import torch.distributed as dist

    sq = sum(t.detach().double().square().sum() for t in engine.optimizer.single_partition_of_fp32_groups)
    dist.all_reduce(sq)
    return float(sq.sqrt())


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def experiences(policy, step: int, shift: float, n: int = 4, prompt: int = 3, resp: int = 4):
    from openrlhf.trainer.ppo_utils.experience_maker import Experience

    g = torch.Generator().manual_seed(1000 * step + RANK)
    seqs = torch.randint(4, 14, (n, prompt + resp), generator=g)
    attn = torch.ones_like(seqs)
    action_mask = torch.ones(n, resp, dtype=torch.bool)
    old = policy.forward(seqs, action_mask, attn).float()  # the trainer's recompute (PolicyModelActor.forward)
    out = []
    for i in range(n):
        sl = slice(i, i + 1)
        adv = torch.randn(1, resp, generator=g)
        out.append(
            Experience(
                sequences=seqs[sl],
                attention_mask=attn[sl],
                action_mask=action_mask[sl],
                action_log_probs=old[sl],
                base_action_log_probs=old[sl].clone(),
                rollout_log_probs=old[sl] + shift,  # vLLM's log-probs
                advantages=adv,
                returns=adv.clone(),
                rewards=torch.rand(1, generator=g),
                response_length=torch.tensor([float(resp)]),
                total_length=torch.tensor([float(prompt + resp)]),
                truncated=torch.tensor([False]),
                info={},
            )
        )
    return out


def fit(policy, step: int, shift: float = 0.0) -> dict:
    for e in experiences(policy, step, shift):
        policy.append(e)
    before = weights(policy.actor.model)
    status = policy.fit(kl_ctl=0.0)
    return {
        "changed": not same(before, weights(policy.actor.model)),
        "after": weights(policy.actor.model),
        "status": status,
    }


def rollback_twice(policy, guard) -> dict:
    """Steps 0-2 healthy (snapshots labelled 1, 2, 3); a broken batch at step 3 restores 1 (the newest older than two
    confirming updates) and abandons 2 and 3; 4 and 5 healthy (snapshots 5, 6); a broken batch at step 6 must find 1
    again. After every step: the labels the ring offers and the tags in the snapshot directory."""
    first, offered, tags, restored = None, [], [], []
    for step in range(7):
        res = fit(policy, step, shift=6.0 if step in (3, 6) else 0.0)
        first = first or res
        offered.append(guard.actions.snapshots.steps())
        tags.append(sorted(n for n in os.listdir(guard.state.snapshot_dir) if n.startswith("rl_guard_step")))
        restored.append(same(res["after"], first["after"]))
    return {"offered": offered, "tags": tags, "restored": restored, "steps": guard.step, "rollbacks": guard.rollbacks}


def main() -> None:
    patch_cuda_calls()
    import torch.distributed as dist

    dist.init_process_group("gloo")
    from openrlhf.trainer.ray.ppo_actor import PolicyModelActor
    from openrlhf.utils import get_strategy

    from rl_guard.adapters import openrlhf_launch

    ckpt = os.path.join(OUT, "ckpt")
    extra = [
        "--actor.model_name_or_path",
        MODEL,
        "--ds.attn_implementation",
        "eager",
        "--ds.zero_stage",
        "2",
        "--vllm.sync_backend",
        "gloo",
        "--vllm.num_engines",
        "0",
        "--train.micro_batch_size",
        "2",
        "--train.batch_size",
        str(4 * WORLD),
        "--rollout.batch_size",
        "4",
        "--actor.adam.lr",
        "1e-2",
        "--actor.lr_warmup_ratio",
        "0",
        "--algo.advantage.estimator",
        "reinforce",
        "--actor.num_gpus_per_node",
        str(WORLD),
        "--ckpt.path",
        ckpt,
        "--ckpt.max_num",
        "3",
    ]
    if PHASE == "resume":
        extra.append("--ckpt.load_enable")
    args = openrlhf_args(extra)
    openrlhf_launch.setup_worker()  # what Ray runs in each worker process of a launched job
    strategy = get_strategy(args)
    policy = PolicyModelActor.__ray_metadata__.modified_class.__new__(PolicyModelActor.__ray_metadata__.modified_class)
    policy.init_model_from_pretrained(strategy, MODEL, max_steps=100, vllm_engines=None)
    guard = policy.trainer.rl_guard
    out = {
        "rank": RANK,
        "patched": PATCHED,
        "backend": dist.get_backend(),
        "guard_step_at_start": guard.step,
        "skipped_at_start": guard.skipped_steps,
        "rollbacks_at_start": guard.rollbacks,
    }
    if PHASE == "train":
        s1, s2 = fit(policy, 1), fit(policy, 2)  # one optimizer step each; a snapshot after step 1 only
        norm_before_3 = master_norm(policy.actor.model)
        s3 = fit(policy, 3, shift=6.0)  # rollout log-probs 6 nats above: weight e^-6 -> rollback to after step 1
        s4 = fit(policy, 4, shift=2.0)  # 2 nats: e^-2 -> skip
        policy.save_checkpoint("global_step4")  # OpenRLHF's own periodic save: carries the guard's state
        out.update(
            applied=[s1["changed"], s2["changed"]],
            moved_after_snapshot=not same(s2["after"], s1["after"]),
            rolled_back=same(s3["after"], s1["after"]),
            skipped_unchanged=not s4["changed"],
            steps=guard.step,
            skipped=guard.skipped_steps,
            rollbacks=guard.rollbacks,
            status_has_guard=sorted(k for k in s1["status"] if k.startswith("rl_guard/behave_imp_weight/")),
            behave_min=[s["status"].get("rl_guard/behave_imp_weight/min") for s in (s1, s3, s4)],
            param_norm=[norm_before_3, s3["status"].get("rl_guard/update/param_norm")],
            update_rel=s2["status"].get("rl_guard/update/rel"),
            snapshot_dir=guard.state.snapshot_dir,
            ckpt_dir=guard.state.ckpt_dir,
            snapshot_tags=sorted(os.listdir(guard.state.snapshot_dir)),
        )
    elif PHASE == "rollback_twice":
        out.update(rollback_twice(policy, guard))
    else:
        out["checkpoint_states"] = sorted(policy.checkpoint_states)
        s5 = fit(policy, 5)
        out.update(applied_after_resume=s5["changed"], steps=guard.step)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
