"""Off-policy correction: the config's refusal, on-policy PPO, decoupled PPO with truncated IS
weights, and that the weights change numerators only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.config import LossConfig
from vgbs_ray.errors import ConfigError
from vgbs_ray.losses.api import LossInputs
from vgbs_ray.losses.builtin import decoupled_ppo
from vgbs_ray.losses.loading import build_loss
from vgbs_ray.layout.microbatch import pack_micro_batch
from vgbs_ray.losses.off_policy import OffPolicyConfig
from vgbs_ray.losses.reduction import METRIC_NAMES, micro_batch_loss, micro_batch_policy_loss
from vgbs_ray.sample import make_rollout
from vgbs_ray.layout.shard import single_micro_batch_shard

DECOUPLED = build_loss("decoupled_ppo", {"is_weight_cap": 2.0}, max_staleness=2)
PPO = build_loss("ppo")


# -- the config --------------------------------------------------------------------------

def test_staleness_without_a_correction_is_refused_unless_allowed():
    stale = OffPolicyConfig(max_staleness=1)
    with pytest.raises(ConfigError, match="max_staleness=1.*'ppo' has no off-policy correction.*decoupled_ppo.*"
                                          "allow_uncorrected_staleness"):
        LossConfig(policy="ppo", off_policy=stale).build()
    LossConfig(policy="ppo", off_policy=OffPolicyConfig(max_staleness=1, allow_uncorrected_staleness=True)).build()
    assert LossConfig(policy="decoupled_ppo", off_policy=stale).build().needs_behaviour_log_probs
    assert not LossConfig().build().needs_behaviour_log_probs


@pytest.mark.parametrize("fields, match", [
    (dict(policy="grpo"), "train.loss.policy='grpo' must be a built-in"),
    (dict(off_policy=OffPolicyConfig(max_staleness=0), aggregation="mean"), "aggregation='mean' is unknown"),
])
def test_bad_fields_are_named(fields, match):
    with pytest.raises(ConfigError, match=match):
        LossConfig(**fields)


@pytest.mark.parametrize("kwargs, match", [
    (dict(is_weight_cap=0.5), "is_weight_cap must be >= 1"),
    (dict(clip_eps=1.5), "clip_eps must be in"),
])
def test_bad_kwargs_are_named(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        build_loss("decoupled_ppo", kwargs)
    with pytest.raises(ConfigError, match="max_staleness must be an int >= 0"):
        OffPolicyConfig(max_staleness=-1)


# -- a micro-batch: 3 rollouts, one of them with 2 samples ------------------------------

def micro_batch():
    rng = np.random.default_rng(0)

    def row(length, response, mask=None):
        return dict(tokens=rng.integers(0, 16, length), response_length=response,
                    loss_mask=np.ones(response, np.int8) if mask is None else np.array(mask, np.int8))

    samples = (make_rollout("a", [row(6, 3), row(8, 4, [1, 0, 1, 1])], reward=1.0, advantage=1.2)
               + make_rollout("b", [row(5, 2)], reward=0.0, advantage=-0.7)
               + make_rollout("c", [row(7, 5, [1, 1, 0, 0, 1])], reward=0.5, advantage=0.4))
    shard = single_micro_batch_shard(samples)
    return pack_micro_batch(shard, range(shard.num_samples)), shard


def log_probs_for(mb, seed):
    generator = torch.Generator().manual_seed(seed)
    return -torch.rand(mb.loss_weight.numel(), generator=generator, dtype=torch.float64) * 2 - 0.1


def hand_loss(token_terms, mb, num_rollouts):
    """sum over samples of sum_t(term_t * mask_t) / max(rollout_mask_sum, 1), / num_rollouts."""
    total, start = 0.0, 0
    for length, denominator in zip(mb.response_lengths.tolist(), mb.rollout_mask_sums.tolist()):
        weight = mb.loss_weight[start:start + length].double()
        total += float((token_terms[start:start + length] * weight).sum()) / max(denominator, 1)
        start += length
    return total / num_rollouts


def token_advantages(mb):
    return torch.repeat_interleave(mb.advantages.double(), mb.response_lengths)


# -- on-policy PPO ---------------------------------------------------------------------------

def test_ppo_is_exactly_the_reference_loss_plus_the_mismatch():
    mb, shard = micro_batch()
    new, behaviour = log_probs_for(mb, 1), log_probs_for(mb, 2)
    expected, expected_pairs = micro_batch_policy_loss(new, behaviour, mb, num_rollouts=3, clip_eps=0.2)
    loss, pairs = micro_batch_loss(PPO, new, mb, behaviour_log_probs=behaviour)
    assert float(loss) == float(expected)
    assert {k: pairs[k] for k in METRIC_NAMES} == expected_pairs
    assert set(pairs) == set(METRIC_NAMES) | {"log_prob_mismatch"}


# -- decoupled PPO -----------------------------------------------------------------------------

def test_decoupled_ppo_weights_each_token_and_keeps_denominators():
    mb, _ = micro_batch()
    new, proximal, behaviour = log_probs_for(mb, 1), log_probs_for(mb, 3), log_probs_for(mb, 2)
    loss, pairs = micro_batch_loss(DECOUPLED, new, mb, behaviour_log_probs=behaviour, proximal_log_probs=proximal)
    ratio = torch.exp(new - proximal)
    advantages = token_advantages(mb)
    surrogate = -torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
    weights = torch.exp(proximal - behaviour).clamp(max=2.0)
    assert float(loss) == pytest.approx(hand_loss(weights * surrogate, mb, 3), rel=1e-12)
    assert (torch.exp(proximal - behaviour) > 2.0).any() and (weights < 1).any()  # both sides exercised
    mask = mb.loss_weight.double()
    assert pairs["is_weight"] == pytest.approx((float((weights * mask).sum()), float(mask.sum())))
    assert pairs["log_prob_mismatch"][0] == pytest.approx(float(((proximal - behaviour).abs() * mask).sum()))


def test_importance_weights_change_numerators_only():
    """A constant weight c scales the loss by exactly c: nothing renormalises by the weights,
    the rollout denominators and num_rollouts are those of the on-policy loss."""
    mb, _ = micro_batch()
    new, proximal = log_probs_for(mb, 1), log_probs_for(mb, 3)
    on_policy, on_pairs = micro_batch_loss(DECOUPLED, new, mb, behaviour_log_probs=proximal,
                                           proximal_log_probs=proximal)
    ppo_vs_proximal, _ = micro_batch_policy_loss(new, proximal, mb, num_rollouts=3, clip_eps=0.2)
    assert float(on_policy) == pytest.approx(float(ppo_vs_proximal), rel=1e-12)  # behaviour == proximal: w = 1
    for c in (0.25, 1.5):
        scaled, pairs = micro_batch_loss(DECOUPLED, new, mb,
                                         behaviour_log_probs=proximal - np.log(c), proximal_log_probs=proximal)
        assert float(scaled) == pytest.approx(c * float(on_policy), rel=1e-9)
        assert pairs["loss"][1] == on_pairs["loss"][1] == 3.0  # rollout shares: the count is untouched
        assert pairs["reward"] == on_pairs["reward"]


def test_weights_are_truncated_at_the_cap_and_carry_no_gradient():
    mb, _ = micro_batch()
    proximal = log_probs_for(mb, 3)
    behaviour = proximal - 5.0  # pi_prox / pi_behave = e^5, far over the cap
    new = proximal.clone().requires_grad_(True)
    loss, pairs = micro_batch_loss(DECOUPLED, new, mb, behaviour_log_probs=behaviour,
                                   proximal_log_probs=proximal)
    loss.backward()
    assert pairs["is_truncated"][0] == pairs["is_truncated"][1] == float(mb.loss_weight.sum())
    # at new == proximal the ratio is 1 (unclipped): d loss / d logp_t = -C * A_t * mask_t / denominator / R
    denominators = torch.repeat_interleave(mb.rollout_mask_sums.double().clamp(min=1), mb.response_lengths)
    expected = -2.0 * token_advantages(mb) * mb.loss_weight.double() / denominators / 3
    torch.testing.assert_close(new.grad, expected)


def test_split_siblings_sum_to_the_whole_micro_batch():
    """The precomputed denominators let a rollout's samples land in different micro-batches."""
    mb, shard = micro_batch()
    new, proximal, behaviour = log_probs_for(mb, 1), log_probs_for(mb, 3), log_probs_for(mb, 2)
    whole, _ = micro_batch_loss(DECOUPLED, new, mb, behaviour_log_probs=behaviour,
                                proximal_log_probs=proximal)
    offsets = shard.response_offsets()
    total = 0.0
    for positions in ([0, 2], [1, 3]):  # rollout "a" (samples 0 and 1) split in two
        part = pack_micro_batch(shard, positions)
        index = torch.cat([torch.arange(offsets[p], offsets[p + 1]) for p in positions])
        loss, _ = micro_batch_loss(DECOUPLED, new[index], part, behaviour_log_probs=behaviour[index],
                                   proximal_log_probs=proximal[index])
        total += float(loss)
    assert total == pytest.approx(float(whole), rel=1e-12)


def test_decoupled_ppo_without_behaviour_log_probs_is_a_clear_error():
    mb, _ = micro_batch()
    new = log_probs_for(mb, 1)
    with pytest.raises(ValueError, match="'decoupled_ppo' .*needs behaviour log-probs .*rollout_log_probs"):
        micro_batch_loss(DECOUPLED, new, mb, behaviour_log_probs=None, proximal_log_probs=new)


def test_token_function_matches_its_formula():
    generator = torch.Generator().manual_seed(7)
    new, proximal, behaviour = (-torch.rand(50, generator=generator, dtype=torch.float64) * 3 for _ in range(3))
    advantages = torch.randn(50, generator=generator, dtype=torch.float64)
    inputs = LossInputs(log_probs=new, old_log_probs=proximal, proximal_log_probs=proximal,
                        behaviour_log_probs=behaviour, advantages=advantages, mask=torch.ones(50, dtype=torch.float64),
                        sample_of_token=torch.zeros(50, dtype=torch.int64), rollout_of_token=torch.zeros(50, dtype=torch.int64),
                        rollout_token_counts=torch.full((50,), 50), versions=None, rollout_log_ratio=None,
                        sample_log_ratio=None)
    output = decoupled_ppo(clip_eps=0.1, is_weight_cap=1.5).compute(inputs)
    ratio = torch.exp(new - proximal)
    raw = torch.exp(proximal - behaviour)
    torch.testing.assert_close(output.metrics["is_weight"], raw.clamp(max=1.5))
    torch.testing.assert_close(output.token_losses, -raw.clamp(max=1.5) * torch.minimum(
        ratio * advantages, ratio.clamp(0.9, 1.1) * advantages))
    assert output.metrics["is_truncated"].tolist() == (raw > 1.5).double().tolist()
    assert 0 < output.metrics["clip_fraction"].sum() < 50
