"""Shared fixtures. Ray starts in-process, once per test session, and stops at the end."""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import tempfile

import pytest

from tests.ray_support import start_local_ray

# Every Ray cluster the tests start (in-process, or a job's subprocess) uses token auth with
# a token of this test session's own, so no test reads, creates or clobbers the user's
# ~/.ray/auth_token. RAY_AUTH_TOKEN would win over the file: drop an inherited one.
_token_dir = tempfile.mkdtemp(prefix="vgbs-test-auth-")
atexit.register(shutil.rmtree, _token_dir, ignore_errors=True)
_token_path = os.path.join(_token_dir, "auth_token")
with open(os.open(_token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as _token_file:
    _token_file.write(secrets.token_hex(32))
os.environ.pop("RAY_AUTH_TOKEN", None)
os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=_token_path)


@pytest.fixture(scope="session")
def ray_session():
    """An in-process local Ray cluster shared by the tests that need one."""
    import ray

    if not ray.is_initialized():
        start_local_ray()
    yield ray
    ray.shutdown()


@pytest.fixture
def cluster_address(ray_session) -> str:
    """The session cluster's address, for a job a test starts as a subprocess (`run.ray_address`): it attaches
    instead of starting a cluster of its own (~5 s). Ray adds a driver's working directory to its workers'
    path, so they import a user's module from the directory the job runs in."""
    return ray_session.get_runtime_context().gcs_address
