"""A token-auth Ray cluster started as a user would (the README's commands in a fresh shell), and what
tests ask it: the dashboard's HTTP API with the token, the metrics port, the state API's tasks and actors."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]


def step_lines(text: str) -> list[str]:
    """The job's step lines in a job log. A line may start mid-line: Ray streams actors' output into the same log,
    and an actor's line without its newline (vLLM's weight-load warning, seen under load) runs into the next."""
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text)  # a job log holds Ray Data's progress-bar escapes
    return [match.group(0) for match in re.finditer(r"step +\d+ \| rollouts[^\n]*", text)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape(port: int) -> str:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except OSError:
        return ""


def http(method: str, url: str, token: str | None = None, body: dict | None = None) -> tuple[int, str]:
    """One request to the dashboard; returns (HTTP status, body), 4xx/5xx included."""
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


# The README's cluster commands start with these two lines: the venv on PATH (the job's
# `python` is whatever is on the head's PATH) and token auth for the cluster and every client.
ACTIVATE = os.path.relpath(pathlib.Path(sys.prefix) / "bin" / "activate", ROOT)  # .venv/bin/activate
README_PRELUDE = f"source {ACTIVATE} && export RAY_AUTH_MODE=token"


def user_shell_env(home: pathlib.Path) -> dict[str, str]:
    """A new terminal's environment: no venv on PATH, no Ray settings (the conftest's test token
    included), and a HOME of its own so `~/.ray/auth_token` is this test's, not the user's."""
    venv_bin = str(pathlib.Path(sys.prefix) / "bin")
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("RAY_") and key not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join(part for part in env.get("PATH", "").split(os.pathsep) if part != venv_bin)
    env["HOME"] = str(home)
    return env


def in_user_shell(command: str) -> list[str]:
    """`command` typed after the README's prelude in a bash shell."""
    return ["bash", "-c", f"{README_PRELUDE} && {command}"]


@contextlib.contextmanager
def token_auth_head(tmp_path: pathlib.Path):
    """A Ray head started with the README's commands in a user's shell (token made with `ray
    get-auth-token --generate`, `ray start --head`), on ports and a temp dir of its own; yields
    (dashboard address, token, the shell's env) once the dashboard answers the token. Stopped after."""
    home = tmp_path / "home"
    home.mkdir()
    env = user_shell_env(home)
    made = subprocess.run(in_user_shell("ray get-auth-token --generate > /dev/null && chmod 600 ~/.ray/auth_token"),
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr[-3000:]
    token_file = home / ".ray" / "auth_token"
    token = token_file.read_text().strip()
    assert re.fullmatch(r"[0-9a-f]{64}", token) and token_file.stat().st_mode & 0o777 == 0o600

    gcs_port, dashboard_port, metrics_port = free_port(), free_port(), free_port()
    # Ray's fixed defaults (dashboard agent 52365, client server 10001) are taken while the suite's
    # in-process cluster runs; a second head whose agent cannot bind never accepts a job.
    agent_port, client_port = free_port(), free_port()
    log = open(tmp_path / "head.log", "w")
    ray_temp_dir = tempfile.mkdtemp(prefix="vgbs-", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    # The README's `ray start`, plus what keeps this cluster apart from any other on the machine
    # (its own ports and temp dir) and `--block` so that stopping this process stops only it.
    head = subprocess.Popen(
        in_user_shell(f"exec ray start --head --num-cpus=8 --dashboard-host=127.0.0.1 --block --port={gcs_port} "
                      f"--dashboard-port={dashboard_port} --metrics-export-port={metrics_port} "
                      f"--dashboard-agent-listen-port={agent_port} --ray-client-server-port={client_port} "
                      f"--temp-dir={ray_temp_dir}"),
        # Stopped by SIGTERM below: Ray 2.60's `--block` then drains the node first, waiting out its 30 s
        # default on a head (nothing here, such as Serve replicas, needs a drain), so it is turned off.
        cwd=ROOT, env=dict(env, RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0"), stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    address = f"http://127.0.0.1:{dashboard_port}"
    try:
        deadline = time.monotonic() + 120
        while True:  # up once it answers the token with 200 (before: refused connections, then 5xx)
            try:
                if http("GET", address + "/api/version", token=token)[0] == 200:
                    break
            except OSError:
                pass
            alive = head.poll() is None and time.monotonic() < deadline
            assert alive, (tmp_path / "head.log").read_text()[-3000:]
            time.sleep(0.5)
        yield address, token, env, metrics_port, gcs_port
    finally:
        head.terminate()  # ray start --block drains and stops this cluster's processes only
        try:
            head.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        log.close()
        shutil.rmtree(ray_temp_dir, ignore_errors=True)


def failed_tasks(address: str, token: str) -> list[dict]:
    """Every FAILED task the cluster's state API knows (`ray list tasks --filter state=FAILED --detail`): its
    function, error type, actor id (None for a task that is not an actor's) and when it was submitted
    (`created_ms`, wall-clock milliseconds)."""
    code, body = http("GET", f"{address}/api/v0/tasks?filter_keys=state&filter_predicates=%3D&filter_values=FAILED"
                             "&limit=10000&detail=1", token=token)
    assert code == 200, body
    return [{"function": t["func_or_class_name"], "error_type": t.get("error_type"), "actor_id": t.get("actor_id"),
             "created_ms": t.get("creation_time_ms")} for t in json.loads(body)["data"]["result"]["result"]]


def alive_actors(address: str, token: str) -> list[dict]:
    """Every ALIVE actor the cluster's state API knows (`ray list actors --filter state=ALIVE`): dicts with
    class_name, name, pid, actor_id."""
    code, body = http("GET", f"{address}/api/v0/actors?filter_keys=state&filter_predicates=%3D&filter_values=ALIVE"
                             "&limit=1000", token=token)
    assert code == 200, body
    return json.loads(body)["data"]["result"]["result"]


def submit_job(address: str, env: dict, entrypoint: str) -> str:
    """`ray job submit --working-dir . --no-wait -- <entrypoint>` in a user's shell; returns the submission id.
    A submit before the head's job agent registered is refused with "No available agent" and creates no
    job, so it is retried (readiness, not a sleep)."""
    deadline = time.monotonic() + 300
    while True:
        submitted = subprocess.run(
            in_user_shell(f"ray job submit --address {address} --working-dir . --no-wait -- {entrypoint}"),
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
        )
        if "No available agent" not in submitted.stderr or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    return re.search(r"Job '(raysubmit_\w+)' submitted successfully", submitted.stdout + submitted.stderr).group(1)


def job_status(address: str, token: str, submission_id: str) -> str:
    code, body = http("GET", f"{address}/api/jobs/{submission_id}", token=token)
    assert code == 200, body
    return json.loads(body)["status"]


def job_logs(address: str, token: str, submission_id: str) -> str:
    code, body = http("GET", f"{address}/api/jobs/{submission_id}/logs", token=token)
    assert code == 200, body
    return json.loads(body)["logs"]
