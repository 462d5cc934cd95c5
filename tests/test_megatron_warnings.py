"""A rank's job log says "Transformer Engine / Apex not installed" at most once per process.

Each case imports the train side in a fresh interpreter (the warnings fire at Megatron's
import, once per importing module), the way a TrainActor's `setup` does.
"""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

IMPORT_TRAIN_SIDE = "import trainer.rank_trainer, trainer.model"


def not_installed_lines(*scripts: str) -> list[list[str]]:
    """Each script's lines that say "not installed"; the scripts run at once (each import is one core's work)."""
    processes = [subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for script in scripts]
    found = []
    try:
        for process in processes:
            stdout, stderr = process.communicate(timeout=180)
            assert process.returncode == 0, stderr[-3000:]
            found.append([line for line in (stdout + stderr).splitlines() if "not installed" in line])
    finally:  # a failed one leaves none of the others running
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return found


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None,
                    reason="Transformer Engine is installed: Megatron-Core does not warn that it is missing, "
                           "so there are no fallback warnings to count")
def test_megatron_fallback_warnings_come_out_once_per_process():
    quiet = ("from trainer.distributed import quiet_megatron_fallback_warnings as q\n"
             f"q(); q()\n{IMPORT_TRAIN_SIDE}\n"
             "import warnings; warnings.warn('Apex is not installed (a later import after the filter)')")
    unfiltered, lines = not_installed_lines(IMPORT_TRAIN_SIDE, quiet)
    # Without the filter, Megatron repeats it from several modules (the case the filter exists for).
    assert len(unfiltered) >= 2
    assert len(lines) == 1 and "Megatron-Core uses its local fallbacks" in lines[0], lines


def test_other_warnings_are_not_filtered():
    script = ("from trainer.distributed import quiet_megatron_fallback_warnings as q; q()\n"
              "import warnings; warnings.warn('Transformer Engine is slow today')")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "Transformer Engine is slow today" in result.stderr
