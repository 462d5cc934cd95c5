"""The floors SPEC keeps: the core imports neither Ray, Megatron nor vLLM; the rank side (trainer/) neither
Ray nor vLLM; the scheduler's process never imports torch (it only lays steps out and moves numpy shards);
no import cycle between the project's modules."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = """
import importlib, sys
importlib.import_module({module!r})
loaded = sorted(name for name in {forbidden!r} if name in sys.modules)
print(",".join(loaded))
"""


@pytest.mark.parametrize("module, forbidden", [
    ("actors.scheduler_actor", ("torch", "megatron", "vllm")),
    ("vgbs_ray.scheduler.intake", ("ray", "torch", "megatron", "vllm")),
    ("vgbs_ray.scheduler.stepping", ("ray", "torch", "megatron", "vllm")),
    ("vgbs_ray.scheduler.policy", ("ray", "torch", "megatron", "vllm")),
])
def test_module_does_not_import(module, forbidden):
    out = subprocess.run([sys.executable, "-c", CHECK.format(module=module, forbidden=forbidden)],
                         capture_output=True, text=True, timeout=120, check=True).stdout.strip()
    assert out == "", f"{module} imports {out}"


ALL_CORE = """
import importlib, pkgutil, sys
import vgbs_ray
for info in pkgutil.walk_packages(vgbs_ray.__path__, "vgbs_ray."):
    importlib.import_module(info.name)
print(",".join(sorted(name for name in ("ray", "megatron", "vllm") if name in sys.modules)))
"""


RANK_SIDE = """
import importlib, pkgutil, sys
import trainer
for info in pkgutil.walk_packages(trainer.__path__, "trainer."):
    importlib.import_module(info.name)
print(",".join(sorted(name for name in ("ray", "vllm") if name in sys.modules)))
"""


def test_the_rank_side_imports_neither_ray_nor_vllm():
    """trainer/ is one rank's Megatron code, driven in-process by tests; the Ray shells live in actors/."""
    out = subprocess.run([sys.executable, "-c", RANK_SIDE], capture_output=True, text=True, timeout=300,
                         check=True).stdout.strip()
    assert out == "", f"trainer imports {out}"


def test_no_core_module_imports_ray_megatron_or_vllm():
    """Every module under vgbs_ray/ at once, new ones included (SPEC: the core imports none of them)."""
    out = subprocess.run([sys.executable, "-c", ALL_CORE], capture_output=True, text=True, timeout=300,
                         check=True).stdout.strip()
    assert out == "", f"vgbs_ray imports {out}"


def _project_imports(path) -> set[str]:
    """Every module name imported anywhere in a file (function-level imports too), but not under
    `if TYPE_CHECKING:` (annotations only, never run)."""
    import ast

    names: set[str] = set()

    def visit(node):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            return
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
            names.add(node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return names


def test_no_import_cycle_between_the_projects_modules():
    """A cycle hidden in a function-level import is still a cycle: modules that need each other are one
    concept split in two, or share a third module both should import."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    modules = {}
    for package in ("vgbs_ray", "actors", "jobs", "trainer"):
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        imported = {n for n in _project_imports(path) if n in modules}
        graph[name] = {n for n in imported if n != name and not name.startswith(n + ".")}  # not its own packages
    cycles, state = [], {}

    def walk(module, trail):
        state[module] = "open"
        for dep in sorted(graph[module]):
            if state.get(dep) == "open":
                cycles.append(trail[trail.index(dep):] + [dep])
            elif dep not in state:
                walk(dep, trail + [dep])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])
    assert not cycles, f"import cycles: {cycles}"
