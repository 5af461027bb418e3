"""One rank of the multi-process sync count: joins a gloo group, runs guard steps under the sync detector and
writes every rank's events per step and call to rank<r>.json.

Usage: python sync_ranks_worker.py RANK WORLD INIT_FILE OUT_DIR STEPS
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the sync detector

import dist_scenarios as sc
from rank_launch import finish
from sync_detector import DEFAULT_SITES, RANK_HEADER, SyncDetector

from rl_guard import Guard


def main() -> None:
    rank, world, init_file, out, steps = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        sys.argv[3],
        Path(sys.argv[4]),
        int(sys.argv[5]),
    )
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard.from_yaml(sc.MERGE_CFG, run_dir=out / f"run{rank}").attach(model, opt)
    guard.use_host_reads(False)  # the tensors stand for a GPU's, where numpy never reads them in place
    det = SyncDetector(documented={**DEFAULT_SITES, **RANK_HEADER})
    record = []
    for step in range(steps):
        seen = {"observe": [], "check": [], "step_done": []}
        for batch, _ in sc.rank_batches(11, step, rank):
            loss = model(torch.randn(3, 4)).pow(2).mean()
            value = loss.detach()
            # what the guard is handed lives on the device: a copy of it into host memory would be a transfer
            det.mark_device(value, *(v for v in vars(batch).values() if isinstance(v, torch.Tensor)))
            with det:
                guard.observe(batch, loss=value)
            seen["observe"] += det.take()
            loss.backward()
        det.mark_device(*model.parameters(), *(p.grad for p in model.parameters()))
        with det:
            guard.check()
        seen["check"] += det.take()
        opt.step()
        opt.zero_grad()
        with det:
            guard.step_done()
        seen["step_done"] += det.take()
        record.append(
            {call: [[e.kind, e.op, e.file, e.function, e.site] for e in events] for call, events in seen.items()}
        )
    guard.close()
    result = {"steps": record, "internal_failures": guard.internal_failures, "world": guard.world_size}
    finish(out / f"rank{rank}.json", result)


if __name__ == "__main__":
    main()
