"""Run a recipe script as ``world`` plain processes (RANK / WORLD_SIZE / MASTER_* set, gloo) and collect the JSON
line each prints last: how the real-framework tests run a framework's engine on 1 and 2 CPU processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def run_ranks(script: Path, args: list[str], world: int, extra_env: dict | None = None, timeout: int = 500) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port(), "WORLD_SIZE": str(world), **(extra_env or {})}
    procs = [subprocess.Popen([sys.executable, str(script), *map(str, args)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    results = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        assert p.returncode == 0, stderr[-4000:]
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    return results
