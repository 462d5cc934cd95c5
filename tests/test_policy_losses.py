"""The loss API and its built-ins against hand computations, one micro-batch at a time (no ranks):
each formula, each aggregation, each correction, GSPO's rollout ratio across micro-batches, and the
bad inputs refused at start. tests/test_policy_loss_ranks.py holds them to dp=1 == dp=2 == pp=2."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vgbs_ray.errors import ConfigError
from vgbs_ray.losses import CorrectionConfig, LossInputs, LossOutput, PolicyLoss
from vgbs_ray.losses.loading import LossOutputError, ResolvedLoss, build_loss
from vgbs_ray.layout.microbatch import pack_micro_batch
from vgbs_ray.losses.reduction import micro_batch_loss
from vgbs_ray.sample import make_rollout
from vgbs_ray.layout.shard import single_micro_batch_shard

# -- a step: 4 rollouts in 2 prompt groups; rollout "a" has 2 samples, "d" 3 ---------------------


def step_shard():
    rng = np.random.default_rng(3)

    def row(length, response, mask=None):
        return dict(tokens=rng.integers(0, 16, length), response_length=response,
                    loss_mask=np.ones(response, np.int8) if mask is None else np.array(mask, np.int8))

    samples = (make_rollout("a", [row(6, 3), row(8, 4, [1, 0, 1, 1])], reward=1.0, advantage=1.2, group_id="p", group_size=2)
               + make_rollout("b", [row(5, 2)], reward=0.0, advantage=-0.7, group_id="p", group_size=2)
               + make_rollout("c", [row(7, 5, [1, 1, 0, 0, 1])], reward=0.5, advantage=0.4, group_id="q", group_size=2)
               + make_rollout("d", [row(4, 2), row(6, 3), row(5, 1)], reward=0.2, advantage=-0.3, group_id="q",
                              group_size=2))
    return single_micro_batch_shard(samples)


SHARD = step_shard()
WHOLE = pack_micro_batch(SHARD, range(SHARD.num_samples))
SAMPLE_ROLLOUT = ["a", "a", "b", "c", "d", "d", "d"]


def log_probs_for(seed, n=None):
    generator = torch.Generator().manual_seed(seed)
    return -torch.rand(n or WHOLE.loss_weight.numel(), generator=generator, dtype=torch.float64) * 2 - 0.1


NEW, BEHAVIOUR = log_probs_for(1), log_probs_for(2)
PROXIMAL = NEW.detach()  # one update per step: the loss forward runs on the step-start weights


def per_sample(values):
    """Split a flat per-token tensor into per-sample tensors of the whole micro-batch."""
    return list(torch.split(values, WHOLE.response_lengths.tolist()))


MASKS = per_sample(WHOLE.loss_weight.double())
ADVANTAGES = [float(a) for a in WHOLE.advantages]


def hand_step_loss(token_terms, aggregation, constant=None):
    """The step loss by its definition (docs/losses.md), written from the samples' own lists."""
    terms = per_sample(token_terms)
    sums = [float((t * m).sum()) for t, m in zip(terms, MASKS)]
    tokens = [float(m.sum()) for m in MASKS]
    if aggregation == "sample_token_mean":
        return sum(s / t for s, t in zip(sums, tokens)) / len(sums)
    if aggregation == "step_token_mean":
        return sum(sums) / sum(tokens)
    by = {"rollout_token_mean": SAMPLE_ROLLOUT, "rollout_token_sum": SAMPLE_ROLLOUT,
          "prompt_token_mean": ["p", "p", "p", "q", "q", "q", "q"]}[aggregation]
    units = {}
    for key, s, t in zip(by, sums, tokens):
        total, count = units.get(key, (0.0, 0.0))
        units[key] = (total + s, count + t)
    if aggregation == "rollout_token_sum":
        return sum(total / constant for total, _ in units.values()) / len(units)
    return sum(total / count for total, count in units.values()) / len(units)


def token_advantages():
    return torch.repeat_interleave(WHOLE.advantages.double(), WHOLE.response_lengths)


def ppo_terms(ratio, low, high):
    a = token_advantages()
    return -torch.minimum(ratio * a, ratio.clamp(1 - low, 1 + high) * a)


def run(policy, kwargs=None, mb=WHOLE, new=NEW, behaviour=BEHAVIOUR, **options):
    loss = build_loss(policy, kwargs or {}, **options)
    return micro_batch_loss(loss, new, mb, behaviour_log_probs=behaviour)


# -- each built-in's formula ------------------------------------------------------------------


def test_ppo_with_clip_higher_and_dual_clip_matches_its_formula():
    ratio = torch.exp(NEW - BEHAVIOUR)
    terms = ppo_terms(ratio, 0.2, 0.3)
    capped = torch.where((token_advantages() < 0) & (terms > -3.0 * token_advantages()), -3.0 * token_advantages(), terms)
    assert (capped != terms).any() and (ratio > 1.3).any()  # both clips exercised
    loss, pairs = run("ppo", {"clip_eps": 0.2, "clip_eps_high": 0.3, "dual_clip": 3.0})
    assert float(loss) == pytest.approx(hand_step_loss(capped, "rollout_token_mean"), rel=1e-12)
    assert pairs["dual_clip_fraction"][0] > 0 and pairs["clip_fraction"][1] == float(WHOLE.loss_weight.sum())


def test_decoupled_ppo_equals_ppo_on_the_proximal_policy_with_token_tis():
    """The two spellings of decoupled PPO give the same loss: the built-in, and ppo anchored on the
    proximal policy with the TIS correction at the same cap."""
    proximal = NEW.detach() + 0.3 * torch.sin(torch.arange(NEW.numel(), dtype=torch.float64))
    loss = build_loss("decoupled_ppo", {"is_weight_cap": 1.5})
    built_in, _ = micro_batch_loss(loss, NEW, WHOLE, behaviour_log_probs=BEHAVIOUR, proximal_log_probs=proximal)
    composed = build_loss("ppo", {"anchor": "proximal"}, correction=CorrectionConfig(kind="tis", high=1.5))
    spelled, pairs = micro_batch_loss(composed, NEW, WHOLE, behaviour_log_probs=BEHAVIOUR, proximal_log_probs=proximal)
    assert float(spelled) == pytest.approx(float(built_in), rel=1e-12)
    weights = torch.exp(proximal - BEHAVIOUR).clamp(max=1.5)
    hand = hand_step_loss(weights * ppo_terms(torch.exp(NEW - proximal), 0.2, 0.2), "rollout_token_mean")
    assert float(built_in) == pytest.approx(hand, rel=1e-12)
    assert 0 < pairs["correction_truncated"][0] < pairs["correction_truncated"][1]


def rollout_means(values):
    """Per token, the mask-weighted mean of `values` over the token's whole rollout (all its samples)."""
    sums, counts = {}, {}
    for rollout, v, m in zip(SAMPLE_ROLLOUT, per_sample(values), MASKS):
        sums[rollout] = sums.get(rollout, 0.0) + float((v * m).sum())
        counts[rollout] = counts.get(rollout, 0.0) + float(m.sum())
    return torch.cat([torch.full((len(v),), sums[r] / counts[r], dtype=torch.float64)
                      for r, v in zip(SAMPLE_ROLLOUT, per_sample(values))])


def test_gspo_clips_one_sequence_ratio_over_every_sample_of_the_rollout():
    """s = exp(mean over the rollout's trained tokens of log pi - log pi_behave); its value decides the clip for
    every token of the rollout, and the gradient is s * grad of that mean (the GSPO-token identity)."""
    new = NEW.clone().requires_grad_(True)
    loss, pairs = run("gspo", {"clip_eps": 0.05, "clip_eps_high": 0.05}, new=new)
    loss.backward()
    reference = NEW.clone().requires_grad_(True)
    log_ratios, masks = per_sample(reference - BEHAVIOUR), MASKS
    hand, clipped = torch.zeros((), dtype=torch.float64), []
    by_rollout = {}
    for index, rollout in enumerate(SAMPLE_ROLLOUT):
        by_rollout.setdefault(rollout, []).append(index)
    for rollout, samples in by_rollout.items():  # the sequence ratio as a function of the whole rollout's tokens
        ratio = torch.exp(sum((log_ratios[i] * masks[i]).sum() for i in samples) / sum(masks[i].sum() for i in samples))
        advantage = ADVANTAGES[samples[0]]
        hand = hand - torch.minimum(ratio * advantage, ratio.clamp(0.95, 1.05) * advantage)
        clipped.append(abs(math.log(float(ratio))) > 0.05)
    (hand / len(by_rollout)).backward()
    assert float(loss) == pytest.approx(float(hand / len(by_rollout)), rel=1e-12)
    torch.testing.assert_close(new.grad, reference.grad, rtol=1e-10, atol=1e-12)
    assert any(clipped) and not all(clipped)  # both branches exercised
    assert pairs["sequence_ratio"][1] == float(WHOLE.loss_weight.sum())


def test_gspo_per_sample_takes_each_sample_alone():
    ratios = torch.exp(torch.cat([torch.full((len(v),), float((v * m).sum() / m.sum()), dtype=torch.float64)
                                  for v, m in zip(per_sample(NEW - BEHAVIOUR), MASKS)]))
    loss, _ = run("gspo", {"level": "sample", "clip_eps": 0.05, "clip_eps_high": 0.05})
    assert float(loss) == pytest.approx(hand_step_loss(ppo_terms(ratios, 0.05, 0.05), "sample_token_mean"), rel=1e-12)


def test_cispo_keeps_every_token_gradient_with_a_truncated_stop_gradient_weight():
    new = NEW.clone().requires_grad_(True)
    loss, pairs = run("cispo", {"clip_eps_high": 0.2}, new=new)
    loss.backward()
    weights = torch.exp(NEW - BEHAVIOUR).clamp(max=1.2)
    hand = hand_step_loss(-weights * token_advantages() * NEW, "step_token_mean")
    assert float(loss) == pytest.approx(hand, rel=1e-12)
    mask = WHOLE.loss_weight.double()
    torch.testing.assert_close(new.grad, -weights * token_advantages() * mask / mask.sum())  # w carries no gradient
    assert 0 < pairs["clip_fraction"][0] < pairs["clip_fraction"][1]


def test_dr_grpo_divides_each_rollout_sum_by_the_budget_and_asks_for_centred_advantages():
    loss = build_loss("dr_grpo", {"max_response_tokens": 16})
    assert loss.policy.scale_advantages_by_std is False
    value, _ = micro_batch_loss(loss, NEW, WHOLE, behaviour_log_probs=BEHAVIOUR)
    assert float(value) == pytest.approx(hand_step_loss(ppo_terms(torch.exp(NEW - BEHAVIOUR), 0.2, 0.2),
                                                        "rollout_token_sum", constant=16), rel=1e-12)
    with pytest.raises(ConfigError, match="dr_grpo.*policy_kwargs.max_response_tokens"):
        build_loss("dr_grpo")


def test_dapo_is_the_token_level_mean_over_the_step_with_clip_higher():
    value, _ = run("dapo")
    assert float(value) == pytest.approx(hand_step_loss(ppo_terms(torch.exp(NEW - BEHAVIOUR), 0.2, 0.28),
                                                        "step_token_mean"), rel=1e-12)


# -- aggregations -------------------------------------------------------------------------------


@pytest.mark.parametrize("aggregation", ["rollout_token_mean", "sample_token_mean", "step_token_mean",
                                         "prompt_token_mean", "rollout_token_sum"])
def test_each_aggregation_is_its_definition_and_splits_exactly(aggregation):
    """The whole micro-batch equals the definition; any split into micro-batches sums back to it (the
    denominators are the step's, so a rollout's or a group's samples may train anywhere)."""
    options = dict(aggregation=aggregation, constant_tokens=7 if aggregation == "rollout_token_sum" else None)
    whole, pairs = run("ppo", **options)
    hand = hand_step_loss(ppo_terms(torch.exp(NEW - BEHAVIOUR), 0.2, 0.2), aggregation, constant=7)
    assert float(whole) == pytest.approx(hand, rel=1e-12)
    assert pairs["loss"][0] / pairs["loss"][1] == pytest.approx(hand, rel=1e-12)  # the reported loss is the step loss
    offsets = SHARD.response_offsets()
    total = 0.0
    for positions in ([0, 3, 5], [1, 2, 4, 6]):  # "a" and "d" split, both groups split
        index = torch.cat([torch.arange(offsets[p], offsets[p + 1]) for p in positions])
        part, _ = run("ppo", mb=pack_micro_batch(SHARD, positions), new=NEW[index], behaviour=BEHAVIOUR[index], **options)
        total += float(part)
    assert total == pytest.approx(hand, rel=1e-12)


# -- corrections ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, level", [("tis", "token"), ("tis", "rollout"), ("mis", "token"), ("mis", "rollout"),
                                         ("icepop", "token"), ("icepop", "rollout")])
def test_each_correction_weights_tokens_by_its_rule(kind, level):
    proximal = PROXIMAL + 0.4 * torch.cos(torch.arange(NEW.numel(), dtype=torch.float64))
    # log rho = a shift per rollout (rollouts a and c outside [0.8, 1.25], b and d inside) + token noise
    shift = {"a": 0.4, "b": 0.05, "c": -0.5, "d": 0.0}
    shifts = torch.cat([torch.full((len(v),), shift[r], dtype=torch.float64) for r, v in zip(SAMPLE_ROLLOUT, per_sample(NEW))])
    behaviour = proximal - shifts - 0.3 * torch.sin(3 * torch.arange(NEW.numel(), dtype=torch.float64))
    config = CorrectionConfig(kind=kind, level=level, low=0.8, high=1.25)
    loss = build_loss("ppo", {"anchor": "proximal"}, correction=config)
    value, pairs = micro_batch_loss(loss, NEW, WHOLE, behaviour_log_probs=behaviour, proximal_log_probs=proximal)
    log_rho = proximal - behaviour if level == "token" else rollout_means(proximal - behaviour)
    rho = torch.exp(log_rho)
    inside = (rho >= 0.8) & (rho <= 1.25)
    weights = rho.clamp(0.8, 1.25) if kind == "tis" else torch.where(inside, rho, 0 * rho)
    hand = hand_step_loss(weights * ppo_terms(torch.exp(NEW - proximal), 0.2, 0.2), "rollout_token_mean")
    assert float(value) == pytest.approx(hand, rel=1e-12)
    share = pairs.get("correction_masked", pairs.get("correction_truncated"))
    assert 0 < share[0] < share[1]  # some tokens inside, some out


def test_a_correction_needs_the_proximal_anchor():
    with pytest.raises(ConfigError, match="correction.kind='tis'.*anchor='behaviour'.*policy_kwargs.anchor=proximal"):
        build_loss("ppo", correction=CorrectionConfig(kind="tis"))
    with pytest.raises(ConfigError, match="kind='icepop' masks tokens outside .*correction.low"):
        CorrectionConfig(kind="icepop")


# -- GSPO's rollout ratio across micro-batches -------------------------------------------------------


def test_gspo_over_a_rollout_split_across_micro_batches_needs_and_uses_the_pre_pass():
    loss = build_loss("gspo", {"clip_eps": 0.05, "clip_eps_high": 0.05})
    whole, _ = micro_batch_loss(loss, NEW, WHOLE, behaviour_log_probs=BEHAVIOUR)
    offsets, ratio = SHARD.response_offsets(), rollout_means(PROXIMAL - BEHAVIOUR)
    total = 0.0
    for positions in ([0, 3, 5], [1, 2, 4, 6]):
        index = torch.cat([torch.arange(offsets[p], offsets[p + 1]) for p in positions])
        part = pack_micro_batch(SHARD, positions)
        with pytest.raises(ValueError, match=r"rollout-level log-ratio of rollouts \[0, 3\].*pre-pass"):
            micro_batch_loss(loss, NEW[index], part, behaviour_log_probs=BEHAVIOUR[index])
        share, _ = micro_batch_loss(loss, NEW[index], part, behaviour_log_probs=BEHAVIOUR[index],
                                    rollout_log_ratio=ratio[index])
        total += float(share)
    assert total == pytest.approx(float(whole), rel=1e-12)


# -- a user's loss and bad input -------------------------------------------------------------------


def make_scaled_reinforce(scale: float = 1.0):
    """A user's loss: REINFORCE on the behaviour policy, scaled (used by the tests below by import path)."""
    def compute(inputs: LossInputs) -> LossOutput:
        return LossOutput(-scale * inputs.advantages * inputs.log_probs, {"scaled": torch.full_like(inputs.mask, scale)})
    return PolicyLoss(name="scaled_reinforce", compute=compute, aggregation="sample_token_mean")


def test_a_user_loss_by_import_path_is_reduced_like_a_built_in():
    loss = build_loss("tests.test_policy_losses:make_scaled_reinforce", {"scale": 2.0})
    value, pairs = micro_batch_loss(loss, NEW, WHOLE, behaviour_log_probs=BEHAVIOUR)
    assert float(value) == pytest.approx(hand_step_loss(-2.0 * token_advantages() * NEW, "sample_token_mean"), rel=1e-12)
    assert pairs["scaled"][0] / pairs["scaled"][1] == 2.0


def wrong_shape():
    return PolicyLoss(name="wrong_shape", compute=lambda inputs: LossOutput(inputs.log_probs.sum().reshape(1)))


def not_finite():
    return PolicyLoss(name="not_finite", compute=lambda inputs: LossOutput(inputs.log_probs / 0.0))


def returns_text():
    return "loss"


@pytest.mark.parametrize("policy, kwargs, match", [
    ("no_such_module:make", {}, r"train.loss.policy='no_such_module:make': cannot import 'no_such_module'"),
    ("tests.test_policy_losses:missing", {}, r"has no 'missing'"),
    ("gspo", {"levels": "rollout"}, r"policy='gspo': policy_kwargs \['levels'\] do not fit its factory gspo\(.*level"),
    ("tests.test_policy_losses:wrong_shape", {}, r"'wrong_shape': token_losses must be a tensor of shape \(5,\).*got \(1,\)"),
    ("tests.test_policy_losses:not_finite", {}, r"'not_finite' returned non-finite token losses"),
    ("tests.test_policy_losses:returns_text", {}, r"returned 'loss': a factory returns a vgbs_ray.losses.PolicyLoss"),
    ("ppo", {"anchor": "engine"}, r"anchor='engine' is unknown"),
])
def test_a_loss_that_cannot_run_is_refused_at_build_naming_it(policy, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        build_loss(policy, kwargs)


def test_a_wrong_output_mid_step_is_named():
    """A loss whose output shape depends on the data passes the probe, and is named at the step."""
    def compute(inputs):
        return LossOutput(inputs.log_probs[:5] if inputs.log_probs.numel() > 5 else -inputs.log_probs)
    loss = ResolvedLoss(policy=PolicyLoss(name="short", compute=compute))
    with pytest.raises(LossOutputError, match=rf"'short': token_losses must be a tensor of shape \({NEW.numel()},\)"):
        micro_batch_loss(loss, NEW, WHOLE, behaviour_log_probs=BEHAVIOUR)


def test_an_untrained_token_never_reaches_the_loss_even_when_not_finite():
    def compute(inputs):
        return LossOutput(torch.where(inputs.mask > 0, -inputs.advantages * inputs.log_probs,
                                      torch.full_like(inputs.log_probs, math.inf)))
    loss = ResolvedLoss(policy=PolicyLoss(name="inf_off_mask", compute=compute))
    value, _ = micro_batch_loss(loss, NEW, WHOLE, behaviour_log_probs=BEHAVIOUR)
    assert math.isfinite(float(value)) and (WHOLE.loss_weight == 0).any()


def test_decoupled_ppo_corrects_each_token_by_the_version_that_sampled_it():
    """A step whose samples' tokens came from three policy versions (weights loaded while requests were in flight):
    each token's behaviour log-prob is its own version's, and the loss weights each token by exp(proximal - that),
    by hand. Treating the sample as sampled by one version (its oldest) gives another loss."""
    versions = [log_probs_for(seed) for seed in (11, 12, 13)]  # the three versions' log-probs of every token
    token_version = torch.tensor([0, 0, 1, 1, 1, 2] * (NEW.numel() // 6 + 1))[:NEW.numel()]
    assert {len(set(v.tolist())) for v in per_sample(token_version) if len(v) >= 3} >= {3}  # a sample spans all three
    behaviour = torch.stack(versions).gather(0, token_version[None])[0]
    proximal = NEW.detach() + 0.2
    loss = build_loss("decoupled_ppo", {"is_weight_cap": 2.0})
    got, _ = micro_batch_loss(loss, NEW, WHOLE, behaviour_log_probs=behaviour, proximal_log_probs=proximal)
    weights = torch.exp(proximal - behaviour).clamp(max=2.0)
    hand = hand_step_loss(weights * ppo_terms(torch.exp(NEW - proximal), 0.2, 0.2), "rollout_token_mean")
    assert float(got) == pytest.approx(hand, rel=1e-12)
    oldest_only, _ = micro_batch_loss(loss, NEW, WHOLE, behaviour_log_probs=versions[0], proximal_log_probs=proximal)
    assert abs(float(oldest_only) - hand) > 1e-3
