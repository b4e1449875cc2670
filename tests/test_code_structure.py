"""Structure the project keeps: no import cycle between its modules, no overlong function."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# import package -> folder
PACKAGES = {"louver_sgl": ROOT / "louver_sgl", "louver_kernels": ROOT / "kernels", "louver_tuning": ROOT / "tuning",
            "louver_eval": ROOT / "eval"}
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, Path]:
    mods = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join((package, *parts))] = path
    return mods


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports anywhere in its file (module level or inside functions)."""
    is_package = path.name == "__init__.py"
    base = name.split(".") if is_package else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            prefix = ".".join(base[: len(base) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (prefix, node.module or "") if p)
            targets = [f"{module}.{alias.name}" for alias in node.names] + [module]
        else:
            continue
        for target in targets:
            while target and target not in known:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):  # parents load first anyway
                found.add(target)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycles():
    mods = _modules()
    graph = {name: _imports(name, path, set(mods)) for name, path in mods.items()}
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _is_triton_kernel(node) -> bool:
    """A ``@triton.jit`` function: the kernel bodies stay as the GPU measured them."""
    return any("jit" in ast.unparse(d) for d in node.decorator_list)


def _long_functions(folders) -> list[str]:
    long = []
    for folder in folders:
        for path in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_triton_kernel(node):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    return long


def test_no_function_is_over_sixty_lines():
    """The runtime, the tuner and the kernels' Python side (the Triton kernel bodies excepted)."""
    long = _long_functions([PACKAGES["louver_sgl"], PACKAGES["louver_tuning"], PACKAGES["louver_kernels"]])
    assert not long, "functions over 60 lines:\n" + "\n".join(long)


def test_the_runtime_package_imports_no_tooling():
    """louver_sgl is what a server imports: it needs neither the evaluation nor the tuner."""
    mods = _modules()
    runtime = {name: _imports(name, path, set(mods)) for name, path in mods.items() if name.startswith("louver_sgl")}
    wrong = {name: sorted(t for t in targets if t.startswith(("louver_eval", "louver_tuning")))
             for name, targets in runtime.items()}
    assert not {k: v for k, v in wrong.items() if v}


POLICY_FIELDS = {"policy", "certified_passes", "certified_rule", "family"}
# the config validates its own fields and answers for the family (``grid_codes``); the policy
# object is the one reader of the policy fields
POLICY_READERS = {ROOT / "louver_sgl" / "config.py", ROOT / "louver_sgl" / "policy.py"}


def _policy_comparisons(tree: ast.AST) -> list[int]:
    """Lines comparing a ``.policy`` / ``.certified_passes`` / ``.certified_rule`` / ``.family`` field."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr in POLICY_FIELDS for s in sides):
                found.append(node.lineno)
    return found


def test_no_policy_string_comparison_outside_the_policy_object():
    """Which threshold rule a step runs is asked of ``config.threshold`` (``ThresholdPolicy``), and
    whether pages carry grid codes of ``config.grid_codes``."""
    wrong = []
    for folder in (PACKAGES["louver_sgl"], PACKAGES["louver_tuning"], PACKAGES["louver_kernels"]):
        for path in folder.rglob("*.py"):
            if path not in POLICY_READERS:
                wrong += [f"{path.relative_to(ROOT)}:{line}" for line in _policy_comparisons(ast.parse(path.read_text()))]
    assert not wrong, "policy fields compared outside the policy object: " + ", ".join(wrong)


def test_the_policy_check_sees_a_comparison():
    assert _policy_comparisons(ast.parse("if config.policy == 'budget': pass\nx = cfg.certified_passes != 2")) == [1, 2]
    assert _policy_comparisons(ast.parse("ok = store.config.family != 'grid'")) == [1]
    assert _policy_comparisons(ast.parse("if config.threshold.budget_rule: pass")) == []
