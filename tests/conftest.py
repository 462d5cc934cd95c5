"""Shared fixtures. Ray starts in-process, once per test session, and stops at the end."""

from __future__ import annotations

import os

import pytest

# Every Ray start in this project uses the same auth mode (see PLATFORM_NOTES: a fresh
# ray.init may otherwise switch on token auth and break later `ray job submit`).
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session")
def ray_session():
    """An in-process local Ray cluster shared by the tests that need one."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=8,  # logical CPUs are bookkeeping; placement groups and Ray Data both need some
            include_dashboard=False,
            object_store_memory=256 << 20,
            log_to_driver=False,
        )
    yield ray
    ray.shutdown()
