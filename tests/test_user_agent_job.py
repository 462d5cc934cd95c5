"""A user's own agent and prompt file train through the job, and a resumed run answers every row once.

As a user would: an agent module written in the test's temporary directory (nothing under
vgbs_ray/, actors/ or jobs/ knows it), named by import path (`rollout.agent`), fed by a
prompt file (`rollout.dataset`), run with `python -m jobs.train` from that directory, attached
to the tests' cluster. Some rows make the agent fail, one way each (raise, hang past the timeout,
non-finite reward, a request longer than the engine takes): those groups are dropped by name and
the rest trains. A run from a JSON Lines file stops after a checkpoint and is resumed with
run.resume=true from the same rows in a Parquet file (both formats feed the job; rows are addressed
by position, so the resume continues at the checkpoint's cursors); it runs until the file is used
up, and the final ledger holds every row's every rollout exactly once: trained in one step (as the
step records say) or dropped with a reason. Slow: two closed-loop jobs, ~2 minutes in all.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

from jobs.progress import read_records

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
GROUP_SIZE = 4
FAILING = {"raise": "agent_error", "hang": "agent_timeout", "nan": "non_finite_reward", "long": "too_long"}

USER_AGENT = '''
"""A user's agent: answer a digit question in a chat; the reward is the answer's token id / 16."""
import asyncio
import math

from vgbs_ray.agents import AgentResult, SamplingConfig


def make_agent(scale: float = 16.0):
    async def agent(row, ctx):
        if row["mode"] == "raise":
            raise RuntimeError("the tool server is down")
        if row["mode"] == "hang":
            await asyncio.Event().wait()  # never returns: only rollout.timeout_s ends it
        question = " ".join(str(d) for d in row["digits"])
        if row["mode"] == "long":
            question = " ".join(["7"] * 64)  # longer than the engine's max_model_len
        chat = ctx.chat([{"role": "user", "content": question}])
        answer = await chat.generate(SamplingConfig(max_tokens=1))
        chat.messages.append({"role": "user", "content": "lower"})
        again = await chat.generate(SamplingConfig(max_tokens=1))
        if row["mode"] == "nan":
            return math.nan
        ids = ctx.tokenizer.convert_tokens_to_ids([answer, again])
        return AgentResult(reward=sum(ids) / (2 * scale), metrics={"turns": 2})

    return agent
'''


def write_user_project(root: pathlib.Path) -> None:
    (root / "my_agents").mkdir(parents=True)
    (root / "my_agents" / "__init__.py").write_text("")
    (root / "my_agents" / "chat_game.py").write_text(textwrap.dedent(USER_AGENT))


def write_prompt_file(root: pathlib.Path, rows: list[dict], kind: str) -> pathlib.Path:
    if kind == "jsonl":
        path = root / "prompts.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = root / "prompts.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def prompt_rows(num_rows: int) -> list[dict]:
    modes = list(FAILING) + ["ok"] * (num_rows - len(FAILING))
    return [{"id": i, "digits": [i % 10, (3 * i) % 10], "mode": modes[i], "source": "test"} for i in range(num_rows)]


def run_job(project: pathlib.Path, dataset: pathlib.Path, out: pathlib.Path, address: str, *extra: str) -> dict:
    # rollout.timeout_s: the "hang" row's group ends only there; an "ok" member (two one-token turns)
    # takes well under a second, also on a busy machine.
    items = [f"run.output_dir={out}", f"run.ray_address={address}", "run.plot=false", "run.checkpoint_every=2",
             "rollout.agent=my_agents.chat_game:make_agent", f"rollout.dataset.path={dataset}",
             "rollout.dataset.keys=[digits,mode]", "rollout.prompts=null",
             f"rollout.tokenizer_dir={ROOT / 'examples' / 'digit_tokenizer'}",
             f"rollout.group_size={GROUP_SIZE}", "rollout.groups_in_flight=2", "rollout.timeout_s=10",
             "scheduler.batch.global_batch_size=8", *extra]
    done = subprocess.run([sys.executable, "-m", "jobs.train", *[a for item in items for a in ("--set", item)]],
                          cwd=project, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def final_ledger(out: pathlib.Path) -> dict:
    checkpoints = out / "checkpoints"
    return json.loads((checkpoints / (checkpoints / "latest").read_text().strip() / "ledger.json").read_text())


def check_failures_dropped_by_name(summary: dict, lost_before: dict | None = None) -> None:
    """The ledger (carried across a resume) drops each failing row's group by its reason, and the run's
    agents lost each such group once (a summary's `failed_groups` counts its own run's producers), except
    those a resumed run's checkpoint already held dropped (`lost_before`: reason -> groups): never again."""
    for reason in FAILING.values():
        assert summary["dropped_by_reason"].get(reason) == GROUP_SIZE, summary["dropped_by_reason"]
    lost_before = lost_before or {}
    expected = {reason: 1 - lost_before.get(reason, 0) for reason in FAILING.values()}
    assert summary["closed_loop"]["failed_groups"] == {reason: n for reason, n in expected.items() if n}


def dropped_groups(ledger: dict) -> dict:
    """reason -> groups of FAILING reasons the checkpoint's ledger holds dropped."""
    dropped = [reason for state, _, reason in ledger["rollouts"].values() if state == "dropped" and reason in FAILING.values()]
    return {reason: dropped.count(reason) // GROUP_SIZE for reason in set(dropped)}


def test_a_users_agent_and_prompt_files_train_and_a_resumed_run_answers_every_row_once(tmp_path, cluster_address):
    rows = prompt_rows(24)
    write_user_project(tmp_path)
    out = tmp_path / "run"
    first = run_job(tmp_path, write_prompt_file(tmp_path, rows, "jsonl"), out, cluster_address, "run.num_steps=2")
    assert first["steps"] == 2
    # A group the first run lost after its last checkpoint is not in that checkpoint: the resumed run answers
    # its row again (agents' calls are redone from a checkpoint, as every rollout is); one it holds, never.
    lost_in_checkpoint = dropped_groups(final_ledger(out))
    for reason, groups in lost_in_checkpoint.items():
        assert groups == 1 and first["closed_loop"]["failed_groups"].get(reason) == 1

    resumed = run_job(tmp_path, write_prompt_file(tmp_path, rows, "parquet"), out, cluster_address,
                      "run.num_steps=100", "run.resume=true")
    records = {r["step"]: r for r in read_records(out / "steps.jsonl")}  # a step is recorded once per run
    ledger = final_ledger(out)["rollouts"]
    expected = {f"e0-row{i}-r{m}" for i in range(len(rows)) for m in range(GROUP_SIZE)}
    assert set(ledger) == expected  # every row's every rollout, none twice, nothing else
    trained = {rid: step for rid, (state, step, _) in ledger.items() if state == "trained"}
    dropped = {rid: reason for rid, (state, _, reason) in ledger.items() if state == "dropped"}
    assert set(trained) | set(dropped) == expected  # nothing left buffered: the file was used up
    assert trained, "nothing trained"
    for step, record in records.items():
        assert record["num_rollouts"] == sum(1 for s in trained.values() if s == step)
    for i, row in enumerate(rows):
        reasons = {dropped.get(f"e0-row{i}-r{m}") for m in range(GROUP_SIZE)}
        if row["mode"] in FAILING:
            assert reasons == {FAILING[row["mode"]]}
        else:  # an answered row trains, or its group is filtered for a uniform reward
            assert reasons <= {None, "uniform_group_reward"}, (i, reasons)
    check_failures_dropped_by_name(resumed, lost_in_checkpoint)  # the resumed run's ledger carries the first run's drops
    assert resumed["steps"] == len(records) - first["steps"] and resumed["incomplete_rollouts"] == 0
    assert resumed["closed_loop"]["agent_metrics"]["turns"] == 2.0
