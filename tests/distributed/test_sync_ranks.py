"""With a gloo process group, the syncs of a guard step are the documented ones and no more
(rl_guard/stats/ranks.py docstring): per optimizer step, one MAX all-reduce (fixed-size header and maxima), one
read of the merged header on the host, one SUM all-reduce, and the step's one device->host transfer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from file_modules import load_module

pytestmark = pytest.mark.slow  # two processes importing torch and the guard: 20-45 s on a loaded machine
HERE = Path(__file__).resolve().parent
child_env = load_module("distributed_launch", HERE / "conftest.py").child_env  # the other multi-process tests' env
STEPS = 3
COLLECTIVE = ["collective", "c10d.allreduce_.default", "rl_guard/stats/ranks.py"]


def run_ranks(world: int, out: Path) -> list:
    out.mkdir(parents=True, exist_ok=True)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "sync_ranks_worker.py"),
                str(r),
                str(world),
                str(out / "pg_init"),
                str(out),
                str(STEPS),
            ],
            env=child_env(),
            cwd=HERE.parents[1],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    logs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * world, "\n".join(logs)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("world", [2])
def test_collectives_and_host_reads_per_step_are_the_documented_ones(world, tmp_path):
    for rank, res in enumerate(run_ranks(world, tmp_path)):
        assert res["world"] == world and res["internal_failures"] == 0
        for step, seen in enumerate(res["steps"]):
            where = f"rank {rank}, step {step}"
            assert seen["step_done"] == [], where
            # observe: nothing but the CPU-only bincount (count_cells; index_add_ on other devices)
            assert {tuple(e[1::3]) for e in seen["observe"]} == {("aten.bincount.default", "cpu-only bincount")}, where
            check = [e for e in seen["check"] if e[4] != "cpu-only bincount"]
            assert [e[:3] for e in check if e[0] == "collective"] == [COLLECTIVE, COLLECTIVE], where  # MAX, then SUM
            assert [(e[1], e[4]) for e in check if e[0] != "collective"] == [
                ("Tensor.cpu", "rank header"),
                ("Tensor.tolist", "rank header"),
                ("Tensor.cpu", "step transfer"),
                ("Tensor.numpy", "step transfer"),
            ], where
            # the order: MAX all-reduce, header read, SUM all-reduce, transfer
            assert [e[4] or e[0] for e in check] == [
                "collective",
                "rank header",
                "rank header",
                "collective",
                "step transfer",
                "step transfer",
            ], where
