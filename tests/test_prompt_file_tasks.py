"""Reading a Parquet prompt file leaves no FAILED task behind (a successful run fails no task).

Ray 2.60's Parquet reader V2 provisions FooterReader actors and kills the idle ones, whose creation tasks
then show FAILED in the state API; `jobs.rollout_source.read_dataset_rows` reads with V1. The check needs the
state API (a dashboard), so it runs in a Ray of its own, in a subprocess (the tests' session cluster has none).
Slow: one Ray start (~15 s).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import json, sys, time
    import pyarrow as pa, pyarrow.parquet as pq
    import ray
    from ray.util.state import list_tasks

    from jobs.job_config import DatasetConfig
    from jobs.rollout_source import read_dataset_rows

    path = sys.argv[1]
    pq.write_table(pa.table({"question": [f"q{i}" for i in range(40)], "answer": list(range(40))}), path)
    context = ray.init(address="local", num_cpus=4, include_dashboard=True, log_to_driver=False)
    rows = read_dataset_rows(DatasetConfig(path=path))
    # this cluster's state API by its own address (the tests' session cluster may be running beside it); task
    # events reach it asynchronously: poll until the read's own task shows as finished, then read every state
    deadline = time.monotonic() + 60
    while True:
        tasks = list_tasks(address=f"http://{context.dashboard_url}", limit=10000, detail=True,
                           raise_on_missing_output=False)
        if any(t.name == "_fetch_parquet_file_info" and t.state == "FINISHED" for t in tasks):
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    print(json.dumps({"rows": rows, "failed": [t.name for t in tasks if t.state == "FAILED"],
                      "finished": [t.name for t in tasks if t.state == "FINISHED"]}))
    ray.shutdown()
""")


def test_a_parquet_prompt_file_is_read_in_order_and_fails_no_task(tmp_path):
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "prompts.parquet")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert [row["answer"] for row in report["rows"]] == list(range(40))  # every row, in file order
    assert report["failed"] == [], report["failed"]
    assert "_fetch_parquet_file_info" in report["finished"]  # the read ran as tasks that finished
