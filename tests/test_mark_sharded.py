"""``Guard.mark_sharded``: adapters whose shards are plain tensors (FSDP1 flat parameters, ZeRO partitions) switch
both the gradient probe and the update probe to merging by sum; an explicit ``sharded_grads`` wins."""

from rl_guard import Guard


def test_mark_sharded_switches_both_probes_unless_the_config_says_otherwise():
    guard = Guard.from_yaml("version: 1\n")
    assert guard.config.sharded_grads is None and not guard.update_probe.sharded
    guard.mark_sharded()
    assert guard.config.sharded_grads is True and guard.update_probe.sharded is True

    explicit = Guard.from_yaml("version: 1\nsharded_grads: false\n")
    explicit.mark_sharded()
    assert explicit.config.sharded_grads is False and not explicit.update_probe.sharded


def test_a_state_with_partitioned_parameters_marks_the_guard_sharded():
    class Partitioned:
        params_sharded = True

    guard = Guard.from_yaml("version: 1\n").attach_state(Partitioned())
    assert guard.update_probe.sharded is True
