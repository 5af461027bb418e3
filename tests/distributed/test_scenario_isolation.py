"""The multi-process worker keeps scenarios apart: one that raises fails its own tests, naming itself, and the
ranks go on in step with the next scenario (a fresh gloo group), in the same processes."""

from __future__ import annotations

import pytest


def test_a_failing_scenario_names_itself_and_leaves_the_next_in_step(launch_bundle, tmp_path):
    # The last rank raises where rank 0 enters an all-reduce: rank 0 waits for it until the collective timeout
    # (shortened here), then fails too; the next scenario's all-reduce must still pair every rank's call.
    run = launch_bundle(2, "fails_on_last_rank,sum_of_ranks", tmp_path, env={"RL_GUARD_TEST_COLLECTIVE_TIMEOUT": "3"})
    assert run.returncodes == [0, 0], run.logs  # a failed scenario is not a failed process
    assert all("error" not in res for res in run.results)
    with pytest.raises(pytest.fail.Exception) as failed:
        run.scenario("fails_on_last_rank")
    text = str(failed.value)
    assert text.startswith("scenario fails_on_last_rank failed on rank(s) [0, 1]")
    assert "RuntimeError: this scenario fails on the last rank" in text  # the last rank's own traceback
    assert [rec["sum"] for rec in run.scenario("sum_of_ranks")] == [1.0, 1.0]  # 0 + 1, on both ranks
