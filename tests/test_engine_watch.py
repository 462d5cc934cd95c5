"""The engine watch's verdict, without Ray: a death, a hang (no answer, or one batch too long), or healthy."""

from __future__ import annotations

import pytest

from jobs.engine_watch import verdict


@pytest.mark.parametrize("answered, died, busy_for_s, waited_s, expected", [
    (True, False, 0.0, 0.1, "healthy"),
    (True, False, 299.0, 0.1, "healthy"),      # a long batch, within the timeout
    (True, False, 301.0, 0.1, "hung"),         # one batch past the timeout: the engine thread is stuck
    (True, True, 0.0, 0.1, "dead"),            # the actor is gone
    (False, False, 0.0, 10.0, "waiting"),      # not answered yet
    (False, False, 0.0, 301.0, "hung"),        # the actor does not answer at all
])
def test_verdict(answered, died, busy_for_s, waited_s, expected):
    assert verdict(answered=answered, died=died, busy_for_s=busy_for_s, waited_s=waited_s,
                   hang_timeout_s=300.0) == expected
