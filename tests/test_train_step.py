"""The train step's correctness, in-process (a world-size-1 gloo group; Megatron GPTModel on CPU).

Each test compares parameter updates of plain SGD (lr 1, no clipping: update = -gradient) in
float32 from the same deterministic init. The multi-rank versions of these checks go through
the real Ray placement group in test_train_group.py; the collective-recording test spawns
two gloo ranks here.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tests.train_support import (assert_same_update, inprocess_trainer, layout_shards, make_samples,
                                 record_collectives_worker, reference_update, relative_difference, run_two_ranks,
                                 sgd_config, update_between)
from vgbs_ray.config import BatchConfig, ParallelConfig
from vgbs_ray.lr_schedule import LRScheduleConfig, lr_at
from vgbs_ray.sample import make_rollout
from vgbs_ray.layout.schedule import build_dp_schedule
from vgbs_ray.layout.shard import build_step_shards


def _schedule(samples, *, dp_size=1, gbs=None, max_tokens=4096, balance="tokens", leftover="partial"):
    gbs = gbs or len({s.rollout_id for s in samples})
    return build_dp_schedule([s.total_length for s in samples], [s.rollout_id for s in samples],
                             ParallelConfig(dp_size=dp_size),
                             BatchConfig(global_batch_size=gbs, max_tokens_per_gpu=max_tokens, balance=balance,
                                         leftover=leftover))


def _train_one_step(config, samples, **schedule_kwargs):
    trainer = inprocess_trainer(config)
    before = trainer.full_parameters()
    shard = build_step_shards(samples, _schedule(samples, **schedule_kwargs).steps[0], 0)[0]
    result = trainer.train_shard(shard)
    return update_between(before, trainer.full_parameters()), result


def test_one_micro_batch_and_many_give_the_same_update():
    samples = make_samples(10, 10)
    one, r1 = _train_one_step(sgd_config(), samples, max_tokens=4096)
    many, r2 = _train_one_step(sgd_config(), samples, max_tokens=100)
    assert r1.num_microbatches == 1 and r2.num_microbatches > 4
    assert_same_update(one, many)
    assert r1.metrics["loss"][0] == pytest.approx(r2.metrics["loss"][0], rel=1e-5)


def test_update_is_mean_over_rollouts_of_token_means():
    samples = make_samples(11, 8)
    update, result = _train_one_step(sgd_config(), samples, max_tokens=120)
    expected = reference_update(sgd_config().model, None, samples, lr=1.0)
    assert_same_update(expected, update)
    assert result.metrics["loss"][1] == pytest.approx(8)  # one unit per rollout
    assert 0 < result.metrics["clip_fraction"][0]  # the test exercises the clipped branch


def test_no_op_with_one_sample_per_rollout():
    samples = make_samples(12, 9, max_siblings=1)
    update, _ = _train_one_step(sgd_config(), samples, max_tokens=150)
    classic = reference_update(sgd_config().model, None, samples, lr=1.0, per_rollout=False)
    assert_same_update(classic, update)


def test_rollout_with_four_samples_weighs_as_much_as_one_with_one():
    base = make_samples(13, 3, max_siblings=1, id_prefix="other")
    single = make_samples(14, 1, max_siblings=1, id_prefix="x")[0]
    row = dict(tokens=single.tokens, response_length=single.response_length, loss_mask=single.loss_mask,
               rollout_log_probs=single.rollout_log_probs)
    one = make_rollout("x", [row], reward=single.reward, advantage=single.advantage)
    four = make_rollout("x", [row] * 4, reward=single.reward, advantage=single.advantage)
    update_one, _ = _train_one_step(sgd_config(), base + one, max_tokens=100)
    update_four, _ = _train_one_step(sgd_config(), base + four, max_tokens=100)
    assert_same_update(update_one, update_four)
    # The per-sample accounting this replaces would weigh "x" four times:
    per_sample = reference_update(sgd_config().model, None, base + four, lr=1.0, per_rollout=False)
    assert relative_difference(update_one, per_sample) > 0.05


def test_variable_size_steps_24_then_8_rollouts():
    samples = make_samples(16, 32, max_siblings=3, max_len=40)
    schedule = _schedule(samples, gbs=24, max_tokens=400)
    assert schedule.num_rollouts == [24, 8]
    lr_config = LRScheduleConfig(lr=2.0, warmup_rollouts=48)  # the LR moves by rollouts, not steps
    config = dataclasses.replace(sgd_config(), optimizer=dataclasses.replace(sgd_config().optimizer,
                                                                           lr_schedule=lr_config))
    trainer = inprocess_trainer(config)
    results = []
    for k, step in enumerate(schedule.steps):
        before = trainer.full_parameters()
        results.append(trainer.train_shard(build_step_shards(samples, step, k)[0]))
        step_samples = [samples[i] for i in step.sample_indices]
        expected = reference_update(config.model, before, step_samples, lr=results[-1].lr)
        assert_same_update(expected, update_between(before, trainer.full_parameters()))
    assert [r.num_rollouts for r in results] == [24, 8]
    assert [r.metrics["loss"][1] for r in results] == pytest.approx([24, 8])
    assert [r.lr for r in results] == pytest.approx([lr_at(lr_config, 24), lr_at(lr_config, 32)])
    assert [r.consumed_rollouts for r in results] == [24, 32]


@pytest.fixture(scope="module")
def recorded_collectives():
    """Every torch.distributed collective of a step, recorded on two spawned gloo ranks: at dp=2 ("layout": a step
    of 8 samples, "lone": a step of one sample) and at pp=2 ("pipelined"), in one spawn (a spawn costs more than
    its steps). Returns {phase: per rank (calls, micro-batches)}, each rank's parameter count at dp=2, and the
    layouts trained."""
    samples = make_samples(17, 8)
    layout = build_step_shards(samples, _schedule(samples, dp_size=2, max_tokens=100).steps[0], 0)
    # a step of one sample: the scheduler gives the second rank only a padding micro-batch; it still joins
    # every collective, the same ones
    lone = layout_shards(make_samples(20, 1, max_siblings=1), dp_size=2, step=1)
    pipelined_samples = make_samples(19, 8)
    pipelined = build_step_shards(pipelined_samples, _schedule(pipelined_samples, max_tokens=100).steps[0], 0)
    runs = [(1, {"layout": layout, "lone": lone}), (2, {"pipelined": pipelined})]
    reports = run_two_ranks(record_collectives_worker, len(runs), runs, timeout_s=180)
    by_phase = {phase: [by_run[index][0][phase] for _, by_run, _ in reports]
                for index, (_, phases) in enumerate(runs) for phase in phases}
    return by_phase, [by_run[0][1] for _, by_run, _ in reports], {"layout": layout, "lone": lone,
                                                                   "pipelined": pipelined}


def test_a_step_issues_only_the_gradient_and_grad_norm_sums(recorded_collectives):
    """Two spawned gloo ranks (dp=2) record every torch.distributed collective of a step."""
    by_phase, num_params, layouts = recorded_collectives
    assert sorted(s.num_samples for s in layouts["lone"]) == [0, 1]
    for rank in range(2):
        calls, num_microbatches = by_phase["layout"][rank]
        assert num_microbatches == layouts["layout"][rank].num_microbatches > 1
        # exactly: Megatron DDP's gradient SUM (one flat buffer), then its optimizer's SUM of the squared
        # grad norm over the model-parallel group. Metrics travel in the result, not in a collective.
        assert calls == [("all_reduce", "SUM", num_params[rank]), ("all_reduce", "SUM", 1)]
        assert by_phase["lone"][rank][0] == calls


def test_a_pipelined_step_agrees_on_no_count(recorded_collectives):
    """PP=2 on two spawned gloo ranks: stages exchange activations point to point, never an all-reduce(MAX)."""
    by_phase, _, layouts = recorded_collectives
    for calls, num_microbatches in by_phase["pipelined"]:
        assert num_microbatches == layouts["pipelined"][0].num_microbatches > 1
        assert not [c for c in calls if c[:2] == ("all_reduce", "MAX")], calls
        point_to_point = [c for c in calls if c[0] in ("send", "recv", "isend", "irecv")]
        assert len(point_to_point) >= 2 * num_microbatches  # activations forward, gradients back (and shapes)


def test_padding_micro_batches_run_as_zero_contributions():
    """Empty entries in a shard's layout (the scheduler's padding) change neither update nor metrics."""
    samples = make_samples(18, 8)
    plain, plain_result = _train_one_step(sgd_config(), samples, max_tokens=120)
    shard = build_step_shards(samples, _schedule(samples, max_tokens=120).steps[0], 0)[0]
    padded = dataclasses.replace(shard, micro_batch_indices=[[], *shard.micro_batch_indices, []],
                                 num_microbatches=shard.num_microbatches + 2)
    trainer = inprocess_trainer(sgd_config())
    before = trainer.full_parameters()
    result = trainer.train_shard(padded)
    assert result.num_microbatches == plain_result.num_microbatches + 2
    assert_same_update(plain, update_between(before, trainer.full_parameters()))
    assert set(result.metrics) == set(plain_result.metrics)
    for name, pair in plain_result.metrics.items():
        assert result.metrics[name] == pytest.approx(pair, rel=1e-6), name


# -- off-policy correction in the step (config.loss.off_policy) -----------------------------------

def _off_policy_config(policy_loss: str, is_weight_cap: float = 2.0):
    from trainer.config import LossConfig

    kwargs = {"is_weight_cap": is_weight_cap} if policy_loss == "decoupled_ppo" else {}
    return sgd_config(loss=LossConfig(policy=policy_loss, policy_kwargs=kwargs))


def _laid_out_shard(seed: int, max_tokens: int = 100):
    """A dp=1 shard whose rollouts spread over several micro-batches (siblings split)."""
    samples = make_samples(seed, 8)
    shard = build_step_shards(samples, _schedule(samples, max_tokens=max_tokens).steps[0], 0)[0]
    assert shard.num_microbatches >= 3
    return shard


def _with_step_start_behaviour(shard):
    """The shard with behaviour log-probs = the fresh trainer's own log-probs (staleness 0, engine
    and trainer holding the same weights): from a separate no-grad forward, scattered back into
    shard order."""
    from vgbs_ray.layout.microbatch import pack_micro_batch

    trainer = inprocess_trainer(sgd_config())
    micro_batches = [pack_micro_batch(shard, p) for p in shard.micro_batch_indices]
    offsets = shard.response_offsets()
    behaviour = np.full(int(offsets[-1]), np.nan, dtype=np.float32)
    for mb, log_probs in zip(micro_batches, trainer.step_start_log_probs(micro_batches)):
        start = 0
        for p, length in zip(mb.positions.tolist(), mb.response_lengths.tolist()):
            behaviour[offsets[p]:offsets[p + 1]] = log_probs[start:start + length].numpy()
            start += length
    assert not np.isnan(behaviour).any()
    return dataclasses.replace(shard, rollout_log_probs=behaviour)


def _train(config, shard):
    trainer = inprocess_trainer(config)
    before = trainer.full_parameters()
    result = trainer.train_shard(shard)
    return update_between(before, trainer.full_parameters()), result


def _value(result, name):
    total, count = result.metrics[name]
    return total / count


def test_at_staleness_zero_decoupled_ppo_is_ppo():
    """Behaviour == step-start log-probs: importance weights are 1, both losses give one update."""
    shard = _with_step_start_behaviour(_laid_out_shard(40))
    ppo, ppo_result = _train(_off_policy_config("ppo"), shard)
    decoupled, result = _train(_off_policy_config("decoupled_ppo"), shard)
    assert_same_update(ppo, decoupled)
    assert set(result.metrics) == set(ppo_result.metrics) | {"is_weight", "is_truncated"}
    assert result.metrics["loss"] == pytest.approx(ppo_result.metrics["loss"], rel=1e-6)
    assert result.metrics["loss"][1] == pytest.approx(shard.num_rollouts)
    assert _value(result, "is_weight") == pytest.approx(1.0, abs=1e-6) and result.metrics["is_truncated"][0] == 0
    for r in (ppo_result, result):  # measured on every response token, against the loss forward's log-probs
        assert r.metrics["log_prob_mismatch"][1] == pytest.approx(float(shard.loss_mask.sum()))
        assert _value(r, "log_prob_mismatch") < 1e-6


@pytest.mark.parametrize("weight", [0.5, 1.5])
def test_a_uniform_importance_weight_scales_the_update_not_the_denominators(weight):
    """Behaviour shifted by -log(c) everywhere: every weight is c (under the cap 2). The update
    and the loss sum scale by exactly c: rollout_mask_sums and the division by the step's
    rollout count stay; a self-normalised (weight-sum) mean would leave the update unchanged."""
    on_policy = _with_step_start_behaviour(_laid_out_shard(41))
    shifted = dataclasses.replace(on_policy, rollout_log_probs=on_policy.rollout_log_probs - np.float32(np.log(weight)))
    config = _off_policy_config("decoupled_ppo")
    base, base_result = _train(config, on_policy)
    scaled, result = _train(config, shifted)
    assert_same_update({k: weight * v for k, v in base.items()}, scaled, rtol=1e-5)
    assert result.metrics["loss"][0] == pytest.approx(weight * base_result.metrics["loss"][0], rel=1e-5)
    assert result.metrics["loss"][1] == base_result.metrics["loss"][1] == pytest.approx(on_policy.num_rollouts)
    assert result.metrics["reward"] == pytest.approx(base_result.metrics["reward"], rel=1e-12)
    assert _value(result, "is_weight") == pytest.approx(weight, rel=1e-5)
    assert _value(result, "log_prob_mismatch") == pytest.approx(abs(np.log(weight)), rel=1e-4)


def _naive_decoupled_update(model_config, shard, *, cap: float, lr: float) -> dict:
    """-lr * gradient of the decoupled PPO step loss, one unpacked sample at a time from the shard's
    arrays: at step start pi == pi_prox, so the ratio is 1 (unclipped) and the gradient of each
    token's term is -w_t * A * grad log pi_t, w_t = min(pi_prox / pi_behave, cap); per rollout
    divided by its mask total (summed here over the rollout's samples), the step by its rollouts."""
    from trainer.model import build_gpt_model

    model = build_gpt_model(model_config)
    tokens_at, responses_at = shard.token_offsets(), shard.response_offsets()
    mask_totals: dict = {}
    for p, rid in enumerate(shard.rollout_ids):
        mask_totals[rid] = mask_totals.get(rid, 0.0) + float(shard.loss_mask[responses_at[p]:responses_at[p + 1]].sum())
    loss = 0.0
    for p, rid in enumerate(shard.rollout_ids):
        tokens = torch.as_tensor(shard.token_ids[tokens_at[p]:tokens_at[p + 1]]).unsqueeze(0)
        length, response = tokens.shape[1], int(shard.response_lengths[p])
        logits = model(tokens, torch.arange(length).unsqueeze(0), None)[0]
        positions = torch.arange(length - response, length)
        new = torch.log_softmax(logits.float(), dim=-1)[positions - 1, tokens[0, positions]]
        behaviour = torch.as_tensor(shard.rollout_log_probs[responses_at[p]:responses_at[p + 1]])
        weights = torch.exp(new.detach() - behaviour).clamp(max=cap)
        mask = torch.as_tensor(shard.loss_mask[responses_at[p]:responses_at[p + 1]])
        loss = loss + (-weights * float(shard.advantages[p]) * torch.exp(new - new.detach()) * mask).sum() \
            / max(mask_totals[rid], 1.0)
    (loss / shard.num_rollouts).backward()
    return {name: (-lr * p.grad.double()).numpy() for name, p in model.named_parameters()}


def test_decoupled_ppo_step_matches_a_naive_per_sample_reference():
    """Stale behaviour log-probs (weights above and below 1, some cut at the cap), siblings split
    over micro-batches: the packed step equals the unpacked per-rollout formula."""
    on_policy = _with_step_start_behaviour(_laid_out_shard(42))
    noise = np.random.default_rng(0).uniform(-1.2, 1.2, on_policy.rollout_log_probs.shape).astype(np.float32)
    stale = dataclasses.replace(on_policy, rollout_log_probs=on_policy.rollout_log_probs + noise)
    update, result = _train(_off_policy_config("decoupled_ppo"), stale)
    assert_same_update(_naive_decoupled_update(sgd_config().model, stale, cap=2.0, lr=1.0), update)
    assert 0 < result.metrics["is_truncated"][0] < result.metrics["is_truncated"][1]
    assert result.metrics["clip_fraction"][0] == 0  # one update per step: pi == pi_prox in its forward
    assert result.metrics["loss"][1] == pytest.approx(stale.num_rollouts)


def test_proximal_from_the_loss_forward_equals_a_separate_no_grad_pass():
    """The trainer takes the proximal policy from its loss forward (detached), not from an extra
    pass: both give the same update and metrics, since the step's one update comes after it."""
    from vgbs_ray.layout.microbatch import pack_micro_batch

    on_policy = _with_step_start_behaviour(_laid_out_shard(43))
    noise = np.random.default_rng(1).uniform(-1.0, 1.0, on_policy.rollout_log_probs.shape).astype(np.float32)
    shard = dataclasses.replace(on_policy, rollout_log_probs=on_policy.rollout_log_probs + noise)
    config = _off_policy_config("decoupled_ppo")
    detached, result = _train(config, shard)

    trainer = inprocess_trainer(config)
    before = trainer.full_parameters()
    micro_batches = [pack_micro_batch(shard, p) for p in shard.micro_batch_indices]
    separate = trainer.step_start_log_probs(micro_batches)
    pairs, _ = trainer._step(micro_batches, [mb.old_log_probs for mb in micro_batches], 1.0, step_start=separate)
    assert_same_update(detached, update_between(before, trainer.full_parameters()), rtol=1e-6)
    assert set(pairs) == set(result.metrics)
    for name, pair in result.metrics.items():
        assert pairs[name] == pytest.approx(pair, rel=1e-6, abs=1e-9), name


def test_decoupled_ppo_refuses_a_shard_without_behaviour_log_probs_before_training():
    samples = make_samples(44, 6, with_log_probs=False)
    shard = build_step_shards(samples, _schedule(samples, max_tokens=100).steps[0], 3)[0]
    trainer = inprocess_trainer(_off_policy_config("decoupled_ppo"))
    before = trainer.full_parameters()
    with pytest.raises(ValueError, match=r"decoupled_ppo' \(correction 'none'\) needs behaviour log-probs \(the samples' "
                                         r"rollout_log_probs\) "
                                         rf"for step 3, dp rank 0: shard positions 0..{shard.num_samples - 1} "
                                         r"\(rollouts \['r\d', .*\] \.\.\.\) lack them"):
        trainer.train_shard(shard)
    after = trainer.full_parameters()
    assert all(np.array_equal(before[k], after[k]) for k in before)  # refused before any update
    assert trainer.consumed_rollouts == 0
    # ppo on the same shard clips against the recomputed step-start policy: ratio 1, nothing to compare
    _, result = _train(_off_policy_config("ppo"), shard)
    assert _value(result, "ratio") == pytest.approx(1.0, rel=1e-6)
    assert result.metrics["log_prob_mismatch"] == (0.0, 0.0)


def nan_beyond_the_probe():
    """A user loss that is finite on the build-time probe (5 tokens) and NaN on a real micro-batch."""
    from vgbs_ray.losses import LossOutput, PolicyLoss

    def compute(inputs):
        poison = 0.0 if inputs.log_probs.numel() <= 5 else float("nan")
        return LossOutput(-inputs.advantages * inputs.log_probs + poison)
    return PolicyLoss(name="nan_beyond_the_probe", compute=compute)


def test_a_non_finite_loss_refuses_the_update_naming_the_step_and_the_loss():
    from trainer.megatron_step import NonFiniteLossError
    from trainer.config import LossConfig

    trainer = inprocess_trainer(sgd_config(loss=LossConfig(policy="tests.test_train_step:nan_beyond_the_probe")))
    shard = _laid_out_shard(45)
    before = trainer.full_parameters()
    with pytest.raises(NonFiniteLossError, match=r"gradient norm nan.*step 0, dp rank 0: policy loss "
                                                 r"'nan_beyond_the_probe' was not finite in micro-batch 0 \(shard positions"):
        trainer.train_shard(shard)
    after = trainer.full_parameters()
    assert all(np.array_equal(before[k], after[k]) for k in before)  # no weight took a NaN
    assert trainer.consumed_rollouts == 0
    # the next finite step trains normally from those weights (the refused step left no gradient behind)
    trainer.loss = LossConfig().build()
    result = trainer.train_shard(shard)
    assert np.isfinite(result.grad_norm) and trainer.consumed_rollouts == shard.num_rollouts


def test_clipping_scales_the_update_by_max_norm_over_the_global_norm():
    """Megatron's clip, run in parts around the non-finite check: the clipped update is the unclipped one times
    max_norm / (norm + 1e-6), and the step reports the norm before clipping."""
    from trainer.config import OptimizerConfig

    shard = _laid_out_shard(46)
    free, free_result = _train(sgd_config(), shard)
    max_norm = free_result.grad_norm / 2  # a scale near 1: float32 parameters keep the update's digits
    clipped_config = dataclasses.replace(sgd_config(), optimizer=dataclasses.replace(
        sgd_config().optimizer, clip_grad_norm=max_norm))
    assert isinstance(clipped_config.optimizer, OptimizerConfig)
    clipped, result = _train(clipped_config, shard)
    assert result.grad_norm == pytest.approx(free_result.grad_norm, rel=1e-6)
    scale = max_norm / (result.grad_norm + 1e-6)
    assert_same_update({k: scale * v for k, v in free.items()}, clipped, rtol=1e-5)
