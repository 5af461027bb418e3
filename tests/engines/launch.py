"""Launching a worker script as ``world`` real processes (gloo, env:// rendezvous) and reading their JSON results."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rank_launch import free_port
from rank_launch import run_torchrun as torchrun

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def child_env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HERE), str(REPO / "tests"), env.get("PYTHONPATH", "")])
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        DS_ACCELERATOR="cpu",
        MASTER_ADDR="127.0.0.1",
        **extra,
    )
    return env


def run_ranks(script: str, world: int, out: Path, *args: str, timeout: float = 240) -> list[dict]:
    """Run ``script`` as ranks 0..world-1; each writes ``out/rank<r>.json``. Fails with the ranks' output."""
    out.mkdir(parents=True, exist_ok=True)
    env = child_env(MASTER_PORT=str(free_port()), WORLD_SIZE=str(world))
    procs = []
    for r in range(world):
        log = open(out / f"rank{r}.log", "w")  # noqa: SIM115 - closed once the rank exits
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, str(HERE / script), str(out), *args],
                    env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                    cwd=REPO,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                ),
                log,
            )
        )
    t0, codes = time.monotonic(), []
    for p, log in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, timeout - (time.monotonic() - t0))))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            codes.append("timeout")
        log.close()
    logs = [(out / f"rank{r}.log").read_text()[-5000:] for r in range(world)]
    assert codes == [0] * world, f"exit codes {codes}\n" + "\n".join(f"--- rank {r}\n{t}" for r, t in enumerate(logs))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def run_torchrun(script: str, world: int, out: Path, *args: str, timeout: float = 300) -> list[dict]:
    """``torch.distributed.run --nproc_per_node world script out args``; each rank writes ``out/rank<r>.json``."""
    return torchrun(HERE / script, world, out, *args, env=child_env(), cwd=REPO, timeout=timeout)
