"""One rank of a multi-process test: joins a gloo group, runs the named scenarios in order, writes rank<r>.json.

Usage: python dist_worker.py RANK WORLD INIT_FILE OUT_DIR scenario[,scenario...]
Collectives time out after 30 s, so a rank left waiting raises instead of blocking the test run.
"""

from __future__ import annotations

import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

import dist_scenarios as sc
from rank_launch import finish

RUNS = {
    "merge": sc.scenario_merge,
    "mismatch": sc.scenario_mismatch,
    "abstain": sc.scenario_abstain,
    "many_groups": sc.scenario_many_groups,
    "skip": lambda r, w, o, log: sc.train_tiny(r, w, o, log, "skip_step"),
    "halt": lambda r, w, o, log: sc.train_tiny(r, w, o, log, "checkpoint_and_halt"),
    "rollback": lambda r, w, o, log: sc.train_tiny(r, w, o, log, "rollback"),
    "grad": lambda r, w, o, log: sc.train_tiny(r, w, o, log, "skip_step", fault="nan_grad"),
    "save_fail": lambda r, w, o, log: sc.train_tiny(r, w, o, log, "checkpoint_and_halt", name="save_fail",
                                                    broken_save=True),
    "recipe": sc.scenario_recipe,
}


def main() -> None:
    rank, world, init_file, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    names = sys.argv[5].split(",")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    log = sc.CollectiveLog()
    result: dict = {"rank": rank, "world": world, "times": {}}
    code = 0
    try:
        for name in names:
            t0 = time.perf_counter()
            result[name] = RUNS[name](rank, world, out, log)
            result["times"][name] = time.perf_counter() - t0
    except Exception:  # noqa: BLE001 - reported to the test, which fails with the traceback
        result["error"] = traceback.format_exc()
        code = 1
    finish(out / f"rank{rank}.json", result, code)


if __name__ == "__main__":
    main()
