"""The tests' in-process Ray cluster: how the session fixture (tests/conftest.py) starts it, and how a
module that needed a cluster of its own starts it again."""

from __future__ import annotations

import os

# How often the session cluster's processes export their metrics (Ray's default: every 10 s). The tests
# that scrape the metrics port wait for one export; at 1 s they wait ~1 s instead of ~10.
METRICS_REPORT_INTERVAL_MS = "1000"


def start_local_ray():
    """Start the tests' in-process local Ray cluster (the session's, or again after a module that needed its own)."""
    import ray

    inherited = os.environ.get("RAY_metrics_report_interval_ms")
    os.environ["RAY_metrics_report_interval_ms"] = METRICS_REPORT_INTERVAL_MS  # read by the processes it starts
    try:
        ray.init(
            address="local",
            num_cpus=8,  # logical CPUs are bookkeeping; placement groups and Ray Data both need some
            include_dashboard=False,
            object_store_memory=256 << 20,
            log_to_driver=False,
        )
    finally:  # jobs the tests start as subprocesses keep what they would have had
        if inherited is None:
            del os.environ["RAY_metrics_report_interval_ms"]
        else:
            os.environ["RAY_metrics_report_interval_ms"] = inherited
