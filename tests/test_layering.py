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
