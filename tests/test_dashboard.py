"""The Grafana dashboard plots series that exist, and the driver's job metrics reach Ray's metrics port."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import ray
from ray.util.metrics import Metric

from actors.scheduler_metrics import SchedulerMetrics
from jobs.job_metrics import METRIC_NAMES, JobMetrics
from jobs.metric_names import step_values
from jobs.progress import StepLine

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "vgbs-dashboard.json"
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _exported_names(ray_session) -> set[str]:
    scheduler = SchedulerMetrics("dashboard-test")
    names = {value.info["name"] for value in vars(scheduler).values() if isinstance(value, Metric)}
    return names | set(METRIC_NAMES)


def _dashboard_series(text: str) -> set[str]:
    series = set()
    for name in re.findall(r"ray_(vgbs_[a-z_]+)", text):
        for suffix in HISTOGRAM_SUFFIXES:
            if name.endswith(suffix) and not name.endswith("_total"):
                name = name[: -len(suffix)]
        series.add(name)
    return series


def test_every_dashboard_series_is_exported_and_every_job_metric_has_a_panel(ray_session):
    dashboard = json.loads(DASHBOARD.read_text())
    panel_exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    exported = _exported_names(ray_session)
    assert _dashboard_series(json.dumps(dashboard)) - exported == set()
    assert set(METRIC_NAMES) - {"vgbs_job_step"} <= _dashboard_series(panel_exprs)  # the step feeds the $run picker
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


def test_job_metrics_reach_the_metrics_export_port(ray_session):
    run = "dashboard-test-run"
    metrics = JobMetrics(run)
    values = step_values(StepLine(step=3, num_rollouts=16, num_samples=20, microbatches_per_rank=1, num_tokens=400,
                                  loss=0.1, reward=0.625, step_time_s=0.2, lr=1e-3,
                                  partial=False, policy_version=4, weight_sync_s=0.5, shard_wait_s=float("nan"),
                                  engine_idle_share=0.25))
    metrics.on_step(3, values)  # names without a gauge (train/loss, step/tokens, ...) are not exported
    for actor in ("engine", "engine", "scheduler"):
        metrics.on_recovery(actor)
    port = ray.nodes()[0]["MetricsExportPort"]
    pattern = re.compile(r'^ray_(vgbs_job_[a-z_]+)\{([^}]*run="%s"[^}]*)\} ([0-9.e+-]+)$' % run, re.M)
    found: dict = {}
    deadline = time.monotonic() + 45
    while time.monotonic() < deadline and len(found) < 8:  # exported every few seconds
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        found = {name + "".join(re.findall(r'actor="([a-z_]+)"', tags)): float(value)
                 for name, tags, value in pattern.findall(text)}
        time.sleep(0.5)
    assert found == {"vgbs_job_step": 3.0, "vgbs_job_step_rollouts": 16.0, "vgbs_job_reward_trained": 0.625,
                     "vgbs_job_policy_version": 4.0, "vgbs_job_time_weight_sync_s": 0.5,
                     "vgbs_job_share_engine_idle": 0.25,  # NaN and None are not set
                     "vgbs_job_recoveries_totalengine": 2.0, "vgbs_job_recoveries_totalscheduler": 1.0}
