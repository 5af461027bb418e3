"""Test sessions: ``nox`` runs them all, ``nox -s tests`` one. Each session builds its own environment with uv,
pinned by ``constraints/<session>.txt`` (the versions CI tests; ``RL_GUARD_RELOCK=1 nox -s <session>`` installs
without them and rewrites the file from what was resolved).

The frameworks pin transformers apart from one another (verl, AReaL <= 5.3, OpenRLHF == 5.15), so each has a
session of its own; the main session holds TRL, wandb, tensorboard and the no-dependency installs of OpenRLHF and
AReaL that the main suite's adapter tests need.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = False
nox.options.error_on_missing_interpreters = True

ROOT = Path(__file__).resolve().parent
CONSTRAINTS = ROOT / "constraints"
PYTHON = "3.11"  # the constraints are resolved for it
# Installed with --no-deps: the packages' own requirements pull CUDA-only builds (flash-attn, vllm, sglang).
OPENRLHF = "openrlhf==0.11.2"
AREAL = "areal==1.0.4"
DEEPSPEED = "deepspeed==0.19.6"
TEST_TOOLS = ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100"]
FRAMEWORK_SUITES = ["tests/adapters/verl", "tests/adapters/areal", "tests/adapters/openrlhf"]


def _pip_find_links() -> list[str]:
    """Wheel folders pip is configured with (``find-links``): uv does not read pip's configuration, and a machine
    that keeps a local torch build there should not download a multi-GB one."""
    links = os.environ.get("PIP_FIND_LINKS", "").split()
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.endswith("find-links"):
            links += value.strip().strip("'\"").split()
    return [link for link in dict.fromkeys(links) if link and Path(link.removeprefix("file://")).exists()]


FIND_LINKS = _pip_find_links()


def _install(
    session: nox.Session,
    name: str,
    *requirements: str,
    no_deps: bool = False,
    no_build_isolation: bool = False,
    latest: bool = False,
) -> None:
    """``uv pip install`` with the session's constraints (``latest``: none but torch's, and the newest releases)."""
    args = [f"--find-links={link}" for link in FIND_LINKS] + ["--constraint", str(CONSTRAINTS / "torch.txt")]
    if latest:
        args.append("--upgrade")
    elif os.environ.get("RL_GUARD_RELOCK") != "1":
        args += ["--constraint", str(CONSTRAINTS / f"{name}.txt")]
    if no_deps:
        args.append("--no-deps")
    if no_build_isolation:
        args.append("--no-build-isolation")
    session.install(*args, *requirements, env={"DS_BUILD_OPS": "0"})


def _relock(session: nox.Session, name: str) -> None:
    if os.environ.get("RL_GUARD_RELOCK") == "1":
        frozen = session.run(
            "uv",
            "pip",
            "freeze",
            "--python",
            session.virtualenv.location,
            "--exclude-editable",
            silent=True,
            external=True,
        )
        CONSTRAINTS.mkdir(exist_ok=True)
        header = f"# nox session '{name}' (python {PYTHON}); rewrite with RL_GUARD_RELOCK=1 nox -s {name}\n"
        # Requirement lines only (uv reports the environment on stderr, which the run captures too); a local
        # build's tag (torch 2.13.0+cpu) is dropped: the pin must resolve on PyPI too.
        lines = [line for line in frozen.splitlines() if re.match(r"^[A-Za-z0-9_.-]+==", line)]
        pins = re.sub(r"^([A-Za-z0-9_.-]+==[^+\s]+)\+\S+$", r"\1", "\n".join(lines) + "\n", flags=re.MULTILINE)
        (CONSTRAINTS / f"{name}.txt").write_text(header + pins, encoding="utf-8")


def _pytest(session: nox.Session, *paths: str, env: dict | None = None) -> None:
    # CI=true: a skipped test fails unless it is marked gpu and no GPU is present (tests/conftest.py).
    run_env = {"HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", **(env or {})}
    session.run("python", "-m", "pytest", "-p", "no:cacheprovider", *paths, *session.posargs, env=run_env)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The main suite: core, TRL (real GRPOTrainer), sinks, report, distributed (gloo), DeepSpeed on CPU."""
    _install(session, "tests", "-e", ".[dev]", "setuptools", "wheel")
    _install(session, "tests", OPENRLHF, AREAL, no_deps=True)
    _install(session, "tests", DEEPSPEED, no_build_isolation=True)
    _relock(session, "tests")
    _pytest(session, "tests", *(f"--ignore={suite}" for suite in FRAMEWORK_SUITES))


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff (lint and format check) over the repository, mypy over the package."""
    _install(session, "lint", "-e", ".", "ruff", "mypy", "types-PyYAML")
    _relock(session, "lint")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy", "rl_guard")


@nox.session(python=PYTHON)
def verl(session: nox.Session) -> None:
    """verl 0.9.1's real actor and Hydra config (its own transformers pin)."""
    _install(session, "verl", "-e", ".", "verl==0.9.1", "uvicorn", "fastapi", *TEST_TOOLS)
    _relock(session, "verl")
    _pytest(session, "tests/adapters/verl")


@nox.session(python=PYTHON)
def areal(session: nox.Session) -> None:
    """AReaL 1.0.4's FSDP engine and controller (transformers <= 5.3)."""
    _install(
        session,
        "areal",
        "-e",
        ".",
        "transformers==5.3.0",
        "peft<=0.18.1",
        "torchdata",
        "datasets",
        "aiohttp>=3.13.3,<4",
        "pydantic",
        "pyyaml",
        "omegaconf==2.4.0.dev2",
        "hydra-core==1.4.0.dev1",
        "orjson",
        "msgspec",
        "zstandard",
        "psutil",
        "einops",
        "httpx",
        "pyzmq",
        "uvloop",
        "tenacity",
        "flask",
        "colorlog",
        "lark",
        "ray",
        "numba",
        "pillow",
        "aiofiles",
        "openai",
        "swanlab==0.6.12",
        "trackio",
        "wandb",
        "tensorboardx",
        "tabulate",
        "pybase64",
        *TEST_TOOLS,
    )
    _install(session, "areal", AREAL, no_deps=True)
    _relock(session, "areal")
    _pytest(session, "tests/adapters/areal")


@nox.session(python=PYTHON)
def openrlhf(session: nox.Session) -> None:
    """OpenRLHF 0.11.2's actor under DeepSpeed on CPU (transformers 5.15, Ray)."""
    _install(
        session,
        "openrlhf",
        "-e",
        ".",
        "transformers==5.15.0",
        "ray==2.55.0",
        "peft",
        "accelerate",
        "datasets",
        "einops",
        "jsonlines",
        "optree",
        "torchdata",
        "tqdm",
        "pylatexenc",
        "aiohttp",
        "pillow",
        "setuptools",
        "wheel",
        *TEST_TOOLS,
    )
    _install(session, "openrlhf", DEEPSPEED, no_build_isolation=True)
    _install(session, "openrlhf", OPENRLHF, no_deps=True)
    _relock(session, "openrlhf")
    _pytest(session, "tests/adapters/openrlhf")


# -- drift: the newest releases, outside CI's pass/fail (nox -s latest latest_verl) --------------------------------
LATEST_ENV = {"RL_GUARD_ALLOW_UNTESTED": "1"}  # attach outside the tested ranges; every seam is still verified


@nox.session(python=PYTHON, default=False)
def latest(session: nox.Session) -> None:
    """The newest trl, transformers, accelerate, deepspeed, openrlhf and areal against the adapters' tests."""
    _install(session, "", "-e", ".[dev]", "setuptools", "wheel", "trl", "transformers", "accelerate", latest=True)
    _install(session, "", "openrlhf", "areal", no_deps=True, latest=True)
    _install(session, "", "deepspeed", no_build_isolation=True, latest=True)
    session.run("uv", "pip", "list", "--python", session.virtualenv.location, external=True)
    _pytest(session, "tests/adapters", "tests/engines", *(f"--ignore={s}" for s in FRAMEWORK_SUITES), env=LATEST_ENV)


@nox.session(python=PYTHON, default=False)
def latest_verl(session: nox.Session) -> None:
    """The newest verl against its adapter's tests."""
    _install(session, "", "-e", ".", "verl", "uvicorn", "fastapi", *TEST_TOOLS, latest=True)
    session.run("uv", "pip", "list", "--python", session.virtualenv.location, external=True)
    _pytest(session, "tests/adapters/verl", env=LATEST_ENV)
