"""The tests' in-process Ray cluster: how the session fixture (tests/conftest.py) starts it, and how a
module that needed a cluster of its own starts it again."""

from __future__ import annotations

import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def cluster_environment() -> dict[str, str]:
    """What the session cluster's processes (and so every worker) get on top of this process's environment:
    - metrics exported every second (Ray's default: 10 s), so the tests that scrape the metrics port wait
      ~1 s for an export instead of ~10;
    - the repository on the path, so the workers of a job that attaches to the cluster from another
      directory (a user's project, tests/test_endpoint_agent_job.py) import `examples` as in a checkout.
    """
    path = os.environ.get("PYTHONPATH")
    return {"RAY_metrics_report_interval_ms": "1000",
            "PYTHONPATH": os.pathsep.join([str(ROOT), path]) if path else str(ROOT)}


def start_local_ray():
    """Start the tests' in-process local Ray cluster (the session's, or again after a module that needed its own)."""
    import ray

    extra = cluster_environment()
    inherited = {name: os.environ.get(name) for name in extra}
    os.environ.update(extra)  # read by the processes ray.init starts
    try:
        ray.init(
            address="local",
            num_cpus=8,  # logical CPUs are bookkeeping; placement groups and Ray Data both need some
            include_dashboard=False,
            object_store_memory=256 << 20,
            log_to_driver=False,
        )
    finally:  # jobs the tests start as subprocesses keep what they would have had
        for name, value in inherited.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
