"""A guarded training process killed hard loses at most the last ``flush_every`` steps of ``metrics.jsonl``: a real
``Guard`` around a real loop (tests/guard_loop.py) in a child process, ended by SIGKILL while idle or by
``os._exit`` in the middle of a step (after ``check``, before ``step_done``); no flush, no atexit hook runs."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_CHILD = """
import os, sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)
from guard_loop import setup, train_step
guard, model, opt, sched = setup(Path({tmp!r}), "sinks: [{{jsonl: {{flush_every: {n}}}}}]\\n")
for s in range({steps}):
    train_step(guard, model, opt, sched)
    print(s, flush=True)
if {exit_mid_step}:  # one more step, cut off between check() and step_done()
    guard.check()
    os._exit(3)
time.sleep(120)
"""


def _strict_lines(path: Path) -> list[dict]:
    """Every line of the file, parsed by a JSON parser that refuses NaN/Infinity literals."""

    def refuse(constant):
        raise AssertionError(f"non-JSON constant {constant}")

    text = path.read_text(encoding="utf-8") if path.exists() else ""
    assert text == "" or text.endswith("\n")  # only whole lines were written
    return [json.loads(line, parse_constant=refuse) for line in text.splitlines()]


@pytest.mark.parametrize("how", ["sigkill", "os._exit"])
def test_a_killed_guarded_run_keeps_every_step_but_the_last_flush_every(tmp_path, how):
    n, steps = 4, 11
    source = _CHILD.format(
        tests=str(ROOT / "tests"), tmp=str(tmp_path), n=n, steps=steps, exit_mid_step=how == "os._exit"
    )
    child = subprocess.Popen([sys.executable, "-c", source], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert [int(child.stdout.readline()) for _ in range(steps)] == list(range(steps))  # all logged
        if how == "sigkill":
            child.send_signal(signal.SIGKILL)
    finally:
        if how == "sigkill" and child.poll() is None:
            child.kill()
        code = child.wait(timeout=120)
        child.stdout.close()
    assert code == (-signal.SIGKILL if how == "sigkill" else 3)
    records = _strict_lines(tmp_path / "run" / "metrics.jsonl")  # guard_loop.setup's run_dir
    on_disk = [r["step"] for r in records]
    assert on_disk == list(range(len(on_disk)))  # a prefix of the run: no step skipped, none repeated
    assert steps - len(on_disk) <= n - 1  # at most the last flush_every - 1 steps lost
    assert on_disk == list(range(steps // n * n))  # flushed every n steps (no rule fired in this healthy loop)
    assert all("rl_guard/grad/norm" in r and "rl_guard/loss/value" in r for r in records)
