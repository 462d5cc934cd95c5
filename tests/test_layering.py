"""The floors SPEC keeps: the core imports neither Ray, Megatron nor vLLM; the scheduler's process
never imports torch (it only lays steps out and moves numpy shards)."""

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
    ("vgbs_ray.intake", ("ray", "torch", "megatron", "vllm")),
    ("vgbs_ray.stepping", ("ray", "torch", "megatron", "vllm")),
    ("vgbs_ray.scheduler_policy", ("ray", "torch", "megatron", "vllm")),
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


def test_no_core_module_imports_ray_megatron_or_vllm():
    """Every module under vgbs_ray/ at once, new ones included (SPEC: the core imports none of them)."""
    out = subprocess.run([sys.executable, "-c", ALL_CORE], capture_output=True, text=True, timeout=300,
                         check=True).stdout.strip()
    assert out == "", f"vgbs_ray imports {out}"
