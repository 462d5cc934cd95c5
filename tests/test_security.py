"""cluster.yaml keeps Ray's token authentication on and the job API off the network.

What a real `ray job submit` against a token-protected cluster does (401 without the token,
the job runs with it) is tested end to end in tests/test_chaos_job.py; this file checks
the launcher config nothing here can start: each rule below, if broken, opens the cluster.
"""

from __future__ import annotations

import pathlib
import re
import subprocess

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOKEN_ON_NODES = "/home/ubuntu/.ray/auth_token"  # Ray's default token path for the nodes' user


def cluster_config() -> dict:
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


def ray_start_commands(config: dict) -> list[str]:
    commands = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    return [command for command in commands if re.search(r"\bray start\b", command)]


def test_every_node_starts_ray_with_token_auth_inside_the_venv():
    starts = ray_start_commands(cluster_config())
    assert len(starts) == 2
    for command in starts:
        assert "RAY_AUTH_MODE=token" in command and "disabled" not in command, command
        # A submitted job's bare `python` must be the venv's (the head's PATH).
        assert command.startswith("source /home/ubuntu/venv/bin/activate && "), command


def test_the_dashboard_listens_on_the_heads_loopback_only():
    (head_start,) = [c for c in ray_start_commands(cluster_config()) if "--head" in c]
    assert re.findall(r"--dashboard-host=(\S+)", head_start) == ["127.0.0.1"]


def test_the_token_is_mounted_from_a_gitignored_file_and_kept_out_of_the_project_sync():
    config = cluster_config()
    source = config["file_mounts"][TOKEN_ON_NODES]
    ignored = subprocess.run(["git", "check-ignore", "-q", source], cwd=ROOT)
    assert ignored.returncode == 0, f"{source} must be gitignored: it holds the cluster's token"
    # The project itself is synced with .gitignore as a filter, so the token (and .venv) stay home.
    assert config["file_mounts"]["/home/ubuntu/vgbs-ray"] == "." and config["rsync_filter"] == [".gitignore"]
    for commands in (config["head_start_ray_commands"], config["worker_start_ray_commands"]):
        chmod = next(i for i, c in enumerate(commands) if f"chmod 600 {TOKEN_ON_NODES}" in c)
        start = next(i for i, c in enumerate(commands) if re.search(r"\bray start\b", c))
        assert chmod < start


def test_cluster_yaml_is_valid_for_the_pinned_ray_launcher():
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(cluster_config()))  # raises on an unknown or misplaced key
