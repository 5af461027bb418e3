"""Launching multi-process tests: a script as ``world`` plain processes (RANK / WORLD_SIZE / MASTER_* set, gloo)
collecting the JSON line each prints last, or under ``torch.distributed.run`` collecting ``out/rank<r>.json``."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def finish(path: Path, result: dict, code: int = 0) -> None:
    """A rank's end: write its results to ``path``, meet the other ranks (unless it failed), tear the process group
    down and ``leave``."""
    import torch.distributed as dist

    path.write_text(json.dumps(result), encoding="utf-8")
    if code == 0:  # a rank tearing gloo down while a peer is still in a collective can abort that peer
        dist.barrier()
    dist.destroy_process_group()
    leave(code)


def leave(code: int = 0) -> None:
    """End a rank process once its results are written and its process group is torn down, without the
    interpreter's teardown: gloo / DeepSpeed thread destructors there abort a finished rank now and then under
    load ("terminate called without an active exception", exit -6)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_ranks(
    script: Path, args: list[str], world: int, extra_env: dict | None = None, timeout: int = 500
) -> list[dict]:
    """Each rank's output goes to a temporary file, not a pipe: a rank blocked on a full pipe while another waits
    for it in a collective would hang. On a timeout every rank is killed and the test fails with their output."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world),
        **(extra_env or {}),
    }
    logs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in range(world)]  # noqa: SIM115
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), *map(str, args)],
            env={**env, "RANK": str(r)},
            stdout=out,
            stderr=err,
            text=True,
            start_new_session=True,
        )
        for r, (out, err) in enumerate(logs)
    ]
    deadline, codes = time.monotonic() + timeout, []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            codes.append(f"killed after {timeout} s")
            p.wait()

    def read(f) -> str:
        f.seek(0)
        return f.read()

    texts = [(read(out), read(err)) for out, err in logs]
    for out, err in logs:
        out.close(), err.close()
    for r, (code, (_, err)) in enumerate(zip(codes, texts)):
        assert code == 0, f"rank {r} of {world}: exit {code}\n{err[-4000:]}"
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in texts]


def run_torchrun(
    script: Path, world: int, out: Path, *args: str, env: dict, cwd: Path = ROOT, timeout: float = 300
) -> list[dict]:
    """``torch.distributed.run --nproc_per_node world script out args``; each rank writes ``out/rank<r>.json``.
    On a timeout the launcher and every rank are killed and the test fails with their output."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(world),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(script),
        str(out),
        *args,
    ]
    proc = subprocess.Popen(
        cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"torchrun launch did not finish within {timeout} s\n{output[-6000:]}") from None
    assert proc.returncode == 0, output[-8000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
