"""Launching real multi-process gloo groups for the distributed tests, once per world size per pytest run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SCENARIOS = {
    2: "merge,skip,halt,rollback,grad,save_fail,abstain,many_groups,mismatch,recipe",
    3: "merge,skip,halt,rollback,grad,save_fail,abstain,many_groups,mismatch",
}
LAUNCH_TIMEOUT = 150  # seconds for a whole bundle; one scenario hanging hits the 30 s collective timeout first


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HERE), str(HERE.parent), env.get("PYTHONPATH", "")])
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


class Launch:
    def __init__(self, world: int, out: Path, returncodes: list, elapsed: float, results: list, logs: list):
        self.world, self.out, self.returncodes, self.elapsed, self.results, self.logs = (
            world,
            out,
            returncodes,
            elapsed,
            results,
            logs,
        )

    def scenario(self, name: str) -> list:
        """Every rank's record of one scenario. Fails the test, naming the scenario, when it raised on a rank (with
        each such rank's traceback; the other scenarios' tests are not concerned), or when a rank never got to its
        end (with that rank's output)."""
        failed = {r: res["failed"][name] for r, res in enumerate(self.results) if res and name in res["failed"]}
        if failed:
            pytest.fail(
                f"scenario {name} failed on rank(s) {sorted(failed)}:\n"
                + "\n".join(f"-- rank {r}:\n{text}" for r, text in failed.items()),
                pytrace=False,
            )
        for r, res in enumerate(self.results):
            if res is None or name not in res:
                why = "wrote no results" if res is None else f"did not reach the end of scenario {name}"
                error = (res or {}).get("error") or ""
                pytest.fail(f"rank {r} {why} (exit {self.returncodes[r]}) {error}\n{self.logs[r]}", pytrace=False)
        return [res[name] for res in self.results]


def launch(world: int, scenarios: str, out: Path, timeout: float = LAUNCH_TIMEOUT, env: dict | None = None) -> Launch:
    out.mkdir(parents=True, exist_ok=True)
    init = out / "pg_init"
    procs = []
    t0 = time.monotonic()
    for r in range(world):
        log = open(out / f"rank{r}.log", "w")  # noqa: SIM115 - closed once the rank exits
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, str(HERE / "dist_worker.py"), str(r), str(world), str(init), str(out), scenarios],
                    env={**child_env(), **(env or {})},
                    cwd=REPO,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                ),
                log,
            )
        )
    codes = []
    for p, log in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, timeout - (time.monotonic() - t0))))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            codes.append("timeout")
        log.close()
    elapsed = time.monotonic() - t0
    results = []
    for r in range(world):
        f = out / f"rank{r}.json"
        results.append(json.loads(f.read_text()) if f.exists() else None)
    logs = [(out / f"rank{r}.log").read_text()[-4000:] for r in range(world)]
    run = Launch(world, out, codes, elapsed, results, logs)
    run.scenarios = scenarios.split(",")
    return run


@pytest.fixture(scope="session")
def launched(tmp_path_factory):
    """``launched(world)``: the bundle of scenarios run by ``world`` real processes (cached for the whole pytest
    run)."""
    cache: dict = {}

    def get(world: int) -> Launch:
        if world not in cache:
            cache[world] = launch(world, SCENARIOS[world], tmp_path_factory.mktemp(f"world{world}"))
        return cache[world]

    return get


@pytest.fixture(scope="session")
def launch_bundle():
    """``launch_bundle(world, scenarios, out, env=...)``: scenarios launched for one test (not cached)."""
    return launch
