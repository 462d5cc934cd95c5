"""actors/gc_tuning.py's pause of the garbage collector: off inside the block, as it was after (also on an error
and when it was off before), and with `freeze` what the block made is skipped by later collections. Each test runs
in a fresh process: the collector's state and its permanent generation are process-wide."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.ray_support import ROOT


def run_isolated(code: str) -> None:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("enabled_before", [True, False])
def test_the_collector_is_off_inside_and_as_it_was_after_also_after_an_error(enabled_before):
    run_isolated(f"""
        import gc
        from actors.gc_tuning import collector_paused
        (gc.enable if {enabled_before} else gc.disable)()
        with collector_paused():
            assert not gc.isenabled()
        assert gc.isenabled() is {enabled_before}
        try:
            with collector_paused(freeze=True):
                raise ValueError("inside")
        except ValueError:
            pass
        assert gc.isenabled() is {enabled_before}
        assert gc.get_freeze_count() == 0  # an error freezes nothing
    """)


def test_freeze_moves_what_the_block_made_out_of_later_collections_until_exit():
    run_isolated("""
        import atexit, gc, os
        def at_exit():  # registered first, so it runs after collector_paused's own exit handler
            if gc.get_freeze_count():  # frozen at exit: extension modules would report leaks
                os._exit(3)  # an exception in an exit handler would not change the exit status
        atexit.register(at_exit)
        from actors.gc_tuning import collector_paused
        before = gc.get_freeze_count()
        with collector_paused(freeze=True):
            made = [[i] for i in range(10_000)]
        assert gc.isenabled() and gc.get_freeze_count() >= before + 10_000
        with collector_paused():
            more = [[i] for i in range(10_000)]
        assert gc.get_freeze_count() < before + 20_000  # without freeze nothing more is frozen
    """)
