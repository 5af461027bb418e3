"""One rank of a multi-process test: runs the named scenarios in order and writes rank<r>.json after each.

Usage: python dist_worker.py RANK WORLD INIT_FILE OUT_DIR scenario[,scenario...]

Each scenario runs in a gloo group of its own (``INIT_FILE.<i>``): one that raises part-way can leave the ranks'
collectives out of step, and a fresh group puts them back in step for the next. A scenario that raises on a rank is
recorded under ``failed`` (that rank's traceback) and the next one still runs, so a test fails for its own scenario
only. Collectives time out after 30 s (``RL_GUARD_TEST_COLLECTIVE_TIMEOUT``), so a rank left waiting for a failed
peer raises instead of blocking the run. Before the group is torn down the ranks compare outcomes through its file
store, which no collective can leave out of step: a rank tearing gloo down while a peer is still in a collective
can abort that peer. The exit code is 0 unless the rank itself could not go on (``error``).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import dist_scenarios as sc
import torch.distributed as dist
from rank_launch import leave

COLLECTIVE_TIMEOUT = timedelta(seconds=float(os.environ.get("RL_GUARD_TEST_COLLECTIVE_TIMEOUT", "30")))
OUTCOME_TIMEOUT = 4 * COLLECTIVE_TIMEOUT  # a peer stuck in a collective raises well before

RUNS = {
    "merge": sc.scenario_merge,
    "mismatch": sc.scenario_mismatch,
    "abstain": sc.scenario_abstain,
    "many_groups": sc.scenario_many_groups,
    "skip": lambda r, w, o, log: sc.train_tiny(r, w, o, log, "skip_step"),
    "halt": lambda r, w, o, log: sc.train_tiny(r, w, o, log, "checkpoint_and_halt"),
    "rollback": lambda r, w, o, log: sc.train_tiny(r, w, o, log, "rollback"),
    "grad": lambda r, w, o, log: sc.train_tiny(r, w, o, log, "skip_step", fault="nan_grad"),
    "save_fail": lambda r, w, o, log: sc.train_tiny(
        r, w, o, log, "checkpoint_and_halt", name="save_fail", broken_save=True
    ),
    "recipe": sc.scenario_recipe,
    "fails_on_last_rank": sc.scenario_fails_on_last_rank,
    "sum_of_ranks": sc.scenario_sum_of_ranks,
}


def run_scenario(name: str, rank: int, world: int, store_file: str, out: Path, log: sc.CollectiveLog):
    """(record, None), or (None, traceback) when the scenario raised on this rank."""
    store = dist.FileStore(store_file, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
    try:
        try:
            record, error = RUNS[name](rank, world, out, log), None
        except Exception:  # noqa: BLE001 - reported to the scenario's tests, which fail with the traceback
            record, error = None, traceback.format_exc()
        store.set(f"outcome/{rank}", "ok" if error is None else "failed")
        keys = [f"outcome/{r}" for r in range(world)]
        store.wait(keys, OUTCOME_TIMEOUT)
        if all(store.get(key) == b"ok" for key in keys):
            dist.barrier()  # every rank is past the scenario's last collective before any tears the group down
    finally:
        dist.destroy_process_group()
    return record, error


def write(path: Path, result: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result), encoding="utf-8")
    tmp.replace(path)


def main() -> None:
    rank, world, init_file, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    names = sys.argv[5].split(",")
    path = out / f"rank{rank}.json"
    log = sc.CollectiveLog()
    result: dict = {"rank": rank, "world": world, "times": {}, "failed": {}}
    code = 0
    for i, name in enumerate(names):
        t0 = time.perf_counter()
        try:
            record, error = run_scenario(name, rank, world, f"{init_file}.{i}", out, log)
        except Exception:  # noqa: BLE001 - the ranks could not meet (a peer died): no later scenario can run
            result["error"] = f"scenario {name}:\n{traceback.format_exc()}"
            code = 1
            break
        finally:
            result["times"][name] = time.perf_counter() - t0
        if error is None:
            result[name] = record
        else:
            result["failed"][name] = error
        write(path, result)  # what ran so far survives a later crash or hang
    write(path, result)
    leave(code)


if __name__ == "__main__":
    main()
