"""The guarded GRPO demo (``rl-guard demo``): a tiny model built locally, real TRL training, an injected fault."""

# The faults ``faults.FaultInjector`` injects; named here, outside the torch-importing module, so that
# ``rl-guard demo --help`` lists them without loading torch.
FAULTS = (
    "none",
    "lr_blowup",
    "lr_ramp",
    "inf_grad",
    "nan_reward",
    "ratio_drift",
    "nan_rewards",
    "reward_scale",
    "weight_noise",
)
