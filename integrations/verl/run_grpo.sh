#!/usr/bin/env bash
# GRPO on GSM8K with verl 0.9.1 (its examples/grpo_trainer recipe, shortened), guarded by rl_guard.
# Needs GPUs, verl with a rollout engine (vLLM) and the GSM8K parquet files verl's data preprocessing writes.
# The lines marked "rl_guard" are all a verl user adds to a command they already run.
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
DATA=${DATA:-$HOME/data/gsm8k}
RUN_DIR=${RUN_DIR:-$PWD/runs/verl_grpo_guard}

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" \
    data.train_batch_size=256 data.max_prompt_length=512 data.max_response_length=1024 \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.calculate_entropy=true \
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 \
    trainer.logger='["console","wandb"]' trainer.project_name=verl_grpo_guard trainer.experiment_name=gsm8k \
    trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.total_epochs=15 trainer.save_freq=20 trainer.test_freq=5 \
    actor_rollout_ref.model.external_lib=rl_guard.adapters.verl `# rl_guard: the workers import the guard` \
    +ray_kwargs.ray_init.runtime_env.env_vars.RL_GUARD_CONFIG=grpo `# rl_guard: preset name or YAML path` \
    +ray_kwargs.ray_init.runtime_env.env_vars.RL_GUARD_RUN_DIR="$RUN_DIR" `# rl_guard: incidents, metrics` \
    "$@"
