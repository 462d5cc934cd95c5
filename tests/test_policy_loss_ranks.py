"""Every built-in loss (and the corrections and aggregations) gives the same update at dp=1, dp=2 and pp=2.

One step of plain SGD (lr 1, no clipping) from the same weights on the same rollouts: an in-process rank
at dp=1 with several micro-batches, two spawned gloo ranks at dp=2 (some rollout's samples on both ranks,
so GSPO's rollout ratio and the rollout-level correction need the pre-pass's all-reduce), and two at pp=2
(Megatron's 1F1B; only the last stage computes the loss). Behaviour log-probs are the step-start policy's
plus noise, so ratios fall on both sides of every clip. Context parallelism needs a GPU here (TE's packed
attention): its part of the reduction (one SUM over CP of the pre-pass's sums) has no CPU test.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from trainer.config import LossConfig
from tests.train_support import (assert_same_update, inprocess_trainer, loss_cases_worker, make_samples,
                                 layout_shards, run_two_ranks, sgd_config, update_between)
from vgbs_ray.losses import CorrectionConfig
from vgbs_ray.metrics import reduce_metric_pairs
from vgbs_ray.layout.microbatch import pack_micro_batch
from vgbs_ray.layout.shard import single_micro_batch_shard

PROXIMAL = {"anchor": "proximal"}
CASES = {
    "ppo_dual_clip": LossConfig(policy="ppo", policy_kwargs={"dual_clip": 2.0}),
    "decoupled_ppo": LossConfig(policy="decoupled_ppo"),
    "gspo_rollout": LossConfig(policy="gspo", policy_kwargs={"clip_eps": 0.02, "clip_eps_high": 0.02}),
    "gspo_sample": LossConfig(policy="gspo", policy_kwargs={"level": "sample", "clip_eps": 0.02, "clip_eps_high": 0.02}),
    "cispo": LossConfig(policy="cispo", policy_kwargs={"clip_eps_high": 0.1}),
    "dr_grpo": LossConfig(policy="dr_grpo", policy_kwargs={"max_response_tokens": 64}),
    "dapo": LossConfig(policy="dapo"),
    "tis_rollout": LossConfig(policy="ppo", policy_kwargs=PROXIMAL,
                              correction=CorrectionConfig(kind="tis", level="rollout", low=0.98, high=1.02)),
    "icepop_token": LossConfig(policy="ppo", policy_kwargs=PROXIMAL,
                               correction=CorrectionConfig(kind="icepop", low=0.8, high=1.25)),
    "prompt_token_mean": LossConfig(policy="ppo", aggregation="prompt_token_mean"),
    "sample_token_mean": LossConfig(policy="ppo", aggregation="sample_token_mean"),
}


def _samples():
    """10 rollouts of 1-4 samples in prompt groups of 2, behaviour = the step-start policy + noise."""
    samples = [dataclasses.replace(s, group_id=f"g{int(str(s.rollout_id)[1:]) // 2}", group_size=2)
               for s in make_samples(61, 10, max_len=60)]
    shard = single_micro_batch_shard(samples)
    start = inprocess_trainer(sgd_config()).step_start_log_probs([pack_micro_batch(shard, range(shard.num_samples))])[0]
    noise = np.random.default_rng(5)
    pieces = np.split(start.numpy(), np.cumsum([s.response_length for s in samples])[:-1])
    return [dataclasses.replace(s, rollout_log_probs=(piece + noise.uniform(-0.3, 0.3, piece.shape)).astype(np.float32))
            for s, piece in zip(samples, pieces)]


def _shards(samples, dp_size: int):
    return layout_shards(samples, dp_size=dp_size, max_tokens=120)


def _spawned(runs: list, initial: dict) -> list[dict]:
    """Per (pp_size, cases) of `runs`: {case: (update, metric pairs summed over the ranks)}, from one spawn of two
    ranks (a spawn costs more than its steps)."""
    (_, first_runs, _), (_, second_runs, _) = run_two_ranks(loss_cases_worker, len(runs), runs,
                                                            initial)
    return [{name: (first[name][0], reduce_metric_pairs([first[name][1], second[name][1]])) for name in first}
            for first, second in zip(first_runs, second_runs)]


@pytest.fixture(scope="module")
def step_results():
    samples = _samples()
    dp1, dp2 = _shards(samples, 1)[0], _shards(samples, 2)
    assert dp1.num_microbatches >= 3
    split = set(dp2[0].rollout_ids) & set(dp2[1].rollout_ids)
    assert split, "some rollout must have samples on both dp ranks"
    reference = inprocess_trainer(sgd_config())
    initial = reference.full_parameters()
    one = {}
    for name, loss in CASES.items():
        trainer = inprocess_trainer(sgd_config(loss=loss))
        trainer.load_full_parameters(initial)
        result = trainer.train_shard(dp1)
        one[name] = (update_between(initial, trainer.full_parameters()), result.metrics)
    # A step of one one-sample rollout: the second dp rank has no sample and must still join the pre-pass's
    # all-reduce (its shard's behaviour log-probs are an empty array, not None), or the first would wait forever.
    lone_samples = [s for s in samples if s.rollout_id == samples[0].rollout_id][:1]
    lone_samples = [dataclasses.replace(lone_samples[0], rollout_size=1, sample_index=0)]
    lone1, lone2 = _shards(lone_samples, 1)[0], _shards(lone_samples, 2)
    assert sorted(s.num_samples for s in lone2) == [0, 1]
    trainer = inprocess_trainer(sgd_config(loss=CASES["gspo_rollout"]))
    trainer.load_full_parameters(initial)
    lone_result = trainer.train_shard(lone1)
    one["gspo_lone_rank"] = (update_between(initial, trainer.full_parameters()), lone_result.metrics)
    cases = list(CASES.items())
    dp2_run = (1, [(n, c, dp2) for n, c in cases] + [("gspo_lone_rank", CASES["gspo_rollout"], lone2)])
    pp2_run = (2, [(n, c, [dp1]) for n, c in cases] + [("gspo_lone_rank", CASES["gspo_rollout"], [lone1])])
    dp2_results, pp2_results = _spawned([dp2_run, pp2_run], initial)
    return {"dp1": one, "dp2": dp2_results, "pp2": pp2_results}


@pytest.mark.parametrize("name", [*CASES, "gspo_lone_rank"])
def test_a_step_is_the_same_update_at_dp1_dp2_and_pp2(step_results, name):
    update, metrics = step_results["dp1"][name]
    assert max(float(np.abs(v).max()) for v in update.values()) > 1e-6  # the step moved the weights
    for layout in ("dp2", "pp2"):
        other, other_metrics = step_results[layout][name]
        assert_same_update(update, other, rtol=1e-5)
        assert set(other_metrics) == set(metrics), layout
        for metric, pair in metrics.items():
            assert other_metrics[metric] == pytest.approx(pair, rel=1e-5, abs=1e-7), (layout, metric)


def test_the_cases_exercise_both_sides_of_their_clips(step_results):
    metrics = {name: result[1] for name, result in step_results["dp1"].items()}
    for name, metric in [("gspo_rollout", "clip_fraction"), ("cispo", "clip_fraction"),
                         ("tis_rollout", "correction_truncated"), ("icepop_token", "correction_masked")]:
        total, count = metrics[name][metric]
        assert 0 < total < count, (name, metric, total, count)
