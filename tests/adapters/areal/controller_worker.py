"""AReaL's single-controller worker, in one process: its RPC server app (``areal.infra.rpc.rpc_server``'s
composition: guard app + data / engine blueprints) driven through Flask's test client with the requests a
``PPOActorController`` sends (areal 1.0.4, ``train_controller.py``): ``/set_env``, ``/create_engine`` with the
controller's dotted engine path, ``/call create_process_group``, ``/call initialize``, then ``compute_logp``,
``compute_advantages`` and ``ppo_update`` as ``PPOTrainer.train`` calls them. Payloads go through AReaL's own
``serialize_value``. Usage: python controller_worker.py <tiny model dir> <out dir>; prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys

MODEL, OUT = sys.argv[1], sys.argv[2]
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, PPOActorConfig  # noqa: E402
from areal.api.io_struct import FinetuneSpec  # noqa: E402
from areal.infra.rpc.guard.app import GuardState, create_app  # noqa: E402
from areal.infra.rpc.guard.data_blueprint import data_bp  # noqa: E402
from areal.infra.rpc.guard.engine_blueprint import engine_bp, register_engine_hooks  # noqa: E402
from areal.infra.rpc.serialization import deserialize_value, serialize_value  # noqa: E402
from areal.utils.environ import is_single_controller  # noqa: E402
from rank_launch import free_port  # noqa: E402  (tests/ is on the PYTHONPATH test_areal_controller.py gives)

GUARD = """version: 1
sinks: [jsonl]
rules:
  - {name: behaviour_far, metric: rl_guard/behave_imp_weight/min, op: '<', threshold: 0.2, action: skip_step}
"""
L, PROMPT = 8, 3


class InProcessTensors:
    """An ``RTensorBackend`` (AReaL's protocol, ``areal.infra.rpc.rtensor.set_backend``) for a controller that
    shares the worker's process: fetch reads the worker's local tensor store instead of going over HTTP."""

    def fetch(self, shards):
        from areal.infra.rpc import rtensor

        with rtensor._storage_lock:
            return [rtensor._storage[s.shard_id] for s in shards]

    def store(self, tensor):
        from areal.infra.rpc.rtensor import HttpRTensorBackend

        return HttpRTensorBackend.store(self, tensor)

    async def delete(self, node_addr, shard_ids):
        return None


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    config_path = os.path.join(OUT, "guard.yaml")
    with open(config_path, "w") as f:
        f.write(GUARD)
    from areal.infra.rpc.rtensor import RTensor, set_backend

    set_backend(InProcessTensors())
    state = GuardState()
    app = create_app(state)
    app.register_blueprint(data_bp)
    app.register_blueprint(engine_bp)
    register_engine_hooks(state)
    client = app.test_client()

    def post(route, **payload):
        r = client.post(route, json=payload)
        assert r.status_code == 200, (route, r.get_json())
        return r.get_json()

    def call(method, *args, **kwargs):
        out = post(
            "/call",
            method=method,
            engine_name="actor/0",
            args=serialize_value(list(args)),
            kwargs=serialize_value(kwargs),
        )
        return deserialize_value(out.get("result"))

    config = PPOActorConfig(
        experiment_name="rl_guard_areal",
        trial_name="controller",
        path=MODEL,
        dtype="float32",
        optimizer=OptimizerConfig(type="adam", lr=1e-2, warmup_steps_proportion=0.0),
        mb_spec=MicroBatchSpec(n_mbs=1),
        ppo_n_minibatches=1,
        use_decoupled_loss=True,
        recompute_logprob=True,
        attn_impl="sdpa",
        backend="fsdp:d1",
        kl_ctl=0.0,
    )
    # The controller side: rl_guard's PPOTrainer builds the actor as AReaL's PPOTrainer.__init__ would
    # (``_create_train_engine(config.actor, alloc)``; the rest of __init__ needs a scheduler and inference servers,
    # so only the fields that method reads are given). It returns AReaL's PPOActorController, whose engine class is
    # what TrainController.initialize sends to the workers as a dotted path, and the guard's settings are in
    # actor.scheduling_spec[*].env_vars, which AReaL's schedulers set in every worker's environment.
    from types import SimpleNamespace

    from areal.api.alloc_mode import ModelAllocation
    from areal.trainer.ppo.actor import PPOActorController

    from rl_guard.adapters.areal_trainer import PPOTrainer

    os.environ["RL_GUARD_CONFIG"] = config_path
    os.environ["RL_GUARD_RUN_DIR"] = os.path.join(OUT, "guard")
    trainer = PPOTrainer.__new__(PPOTrainer)
    trainer.scheduler = None
    trainer.config = SimpleNamespace(
        actor=config,
        experiment_name="e",
        trial_name="t",
        cluster=SimpleNamespace(fileroot=OUT),
        rollout=SimpleNamespace(max_head_offpolicyness=2),
    )
    controller = trainer._create_train_engine(config, ModelAllocation.from_str("fsdp:d1"))
    assert isinstance(controller, PPOActorController), type(controller)
    engine_path = f"{controller.train_engine.__module__}.{controller.train_engine.__name__}"
    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "LOCAL_RANK": "0",
        **config.scheduling_spec[0].env_vars,
    }
    for key in ("RL_GUARD_CONFIG", "RL_GUARD_RUN_DIR"):
        del os.environ[key]  # the worker gets them only through /set_env, as a separate process would
    post("/set_env", env=env)
    post(
        "/create_engine",
        engine=engine_path,
        engine_name="actor/0",
        init_args=serialize_value([]),
        init_kwargs=serialize_value({"config": config}),
    )
    call("create_process_group", parallel_strategy=None)
    call("initialize", None, FinetuneSpec(total_train_epochs=1, dataset_size=8, train_batch_size=4))
    call("set_version", 3)

    def step(seed, shift):
        g = torch.Generator().manual_seed(seed)
        data = []
        for _ in range(4):
            mask = torch.zeros(1, L, dtype=torch.int32)
            mask[:, PROMPT:] = 1
            versions = torch.full((1, L), 2, dtype=torch.int32)
            versions[:, :PROMPT] = -1
            data.append(
                {
                    "input_ids": torch.randint(4, 14, (1, L), generator=g),
                    "attention_mask": torch.ones(1, L, dtype=torch.int32),
                    "loss_mask": mask,
                    "versions": versions,
                    "logprobs": torch.zeros(1, L),
                    "rewards": torch.rand(1, generator=g),
                }
            )
        prox = RTensor.localize(call("compute_logp", data))
        for traj, lp in zip(data, prox):
            traj["logprobs"][:, 1:] = lp[:, :-1] + shift
            traj["prox_logp"] = lp
        adv = call("compute_advantages", data)
        call("ppo_update", adv)
        return call("rl_guard_summary")

    healthy, far = step(1, 0.0), step(2, 2.0)
    from rl_guard import Guard
    from rl_guard.adapters.areal import install

    try:  # the proxy has no engine in this process: install() says what to do instead of failing obscurely
        install(controller, Guard.from_yaml(GUARD, run_dir=os.path.join(OUT, "proxy")))
        proxy_error = None
    except TypeError as exc:
        proxy_error = str(exc)
    print(
        json.dumps(
            {
                "single_controller": is_single_controller(),
                "engine_path": engine_path,
                "proxy_error": proxy_error,
                "worker_env": sorted(k for k in env if k.startswith("RL_GUARD_")),
                "healthy": {
                    k: healthy.get(k) for k in ("step", "skipped", "rl_guard/lag/max", "rl_guard/behave_imp_weight/min")
                },
                "far": {k: far.get(k) for k in ("step", "skipped", "rl_guard/behave_imp_weight/min")},
            }
        )
    )
    os._exit(0)  # the RPC app's engine thread is not a daemon


if __name__ == "__main__":
    main()
