"""The package layout holds: imports go one way (no cycles) and the core imports no trainer framework."""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "rl_guard"
FRAMEWORKS = ("trl", "transformers", "accelerate", "openrlhf", "areal", "deepspeed", "verl", "ray", "vllm")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PKG.rglob("*.py")}


def imports(name: str) -> tuple[set[str], set[str]]:
    """(rl_guard modules, top-level external packages) imported anywhere in the module, lazily or not."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    internal, external = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    internal.add(sub if sub in MODULES else target)
            else:
                (internal if node.module.startswith("rl_guard") else external).add(
                    node.module if node.module.startswith("rl_guard") else node.module.split(".")[0]
                )
        elif isinstance(node, ast.Import):
            for alias in node.names:
                (internal if alias.name.startswith("rl_guard") else external).add(
                    alias.name if alias.name.startswith("rl_guard") else alias.name.split(".")[0]
                )
    return {m for m in internal if m in MODULES and m != name}, external


def test_no_import_cycles():
    graph = {m: imports(m)[0] for m in MODULES}
    state: dict[str, int] = {}
    cycles = []

    def visit(m, stack):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n) :] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


# Adapters translate one framework each; the demo is the guarded TRL run behind ``rl-guard demo``.
CORE = sorted(m for m in MODULES if not m.startswith(("rl_guard.adapters", "rl_guard.demo")))


@pytest.mark.parametrize("name", CORE)
def test_core_imports_no_trainer_framework(name):
    assert not imports(name)[1] & set(FRAMEWORKS), f"{name} imports {imports(name)[1] & set(FRAMEWORKS)}"


def test_the_layout_separates_engine_and_control():
    assert {"rl_guard.stats.families", "rl_guard.stats.sketch", "rl_guard.stats.ranks"} <= set(MODULES)
    assert {"rl_guard.control.rules", "rl_guard.control.controller", "rl_guard.control.actions"} <= set(MODULES)
    for name in MODULES:
        if name.startswith("rl_guard.stats"):  # the engine knows nothing of rules or actions
            assert not any(m.startswith("rl_guard.control") for m in imports(name)[0]), name
