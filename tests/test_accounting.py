"""Loss and metric accounting per rollout (SPEC "Loss accounting per rollout")."""

from __future__ import annotations

import numpy as np
import torch

from vgbs_ray.losses.accounting import clipped_policy_loss, rollout_mask_sums, sum_of_sample_contributions, token_advantages
from vgbs_ray.metrics import add_metric, metric_values, reduce_metric_pairs


def random_batch(rng, rollout_sizes):
    rollout_ids, lengths, masks = [], [], []
    for r, size in enumerate(rollout_sizes):
        for _ in range(size):
            n = int(rng.integers(1, 9))
            rollout_ids.append(f"r{r}")
            lengths.append(n)
            masks.append(rng.integers(0, 2, n))
    values = torch.tensor(rng.normal(size=sum(lengths)), dtype=torch.float64)
    return rollout_ids, torch.tensor(lengths), torch.tensor(np.concatenate(masks), dtype=torch.float64), values, masks


def test_rollout_mask_sums_cover_the_whole_rollout():
    sums = rollout_mask_sums(["a", "b", "a"], [[1, 1, 0], [1], [1, 0, 1, 1]])
    assert sums.tolist() == [5, 1, 5]


def test_siblings_anywhere_rebuild_one_token_weighted_mean_per_rollout():
    rng = np.random.default_rng(0)
    rollout_ids, lengths, mask, values, masks = random_batch(rng, [1, 4, 2, 3])
    denominators = torch.tensor(rollout_mask_sums(rollout_ids, masks))
    # Expected: for each rollout, its token-weighted mean over all its samples' masked tokens.
    offsets = np.concatenate([[0], np.cumsum(lengths.numpy())])
    expected = 0.0
    for rid in dict.fromkeys(rollout_ids):
        idx = [i for i, r in enumerate(rollout_ids) if r == rid]
        num = sum(float((values[offsets[i]:offsets[i + 1]] * mask[offsets[i]:offsets[i + 1]]).sum()) for i in idx)
        den = sum(float(mask[offsets[i]:offsets[i + 1]].sum()) for i in idx)
        expected += num / max(den, 1)
    # Computed in arbitrary micro-batches (here: one sample each, shuffled) and summed.
    total = 0.0
    for i in rng.permutation(len(rollout_ids)):
        sl = slice(offsets[i], offsets[i + 1])
        total += float(sum_of_sample_contributions(values[sl], lengths[i:i + 1], mask[sl], denominators[i:i + 1]))
    whole = float(sum_of_sample_contributions(values, lengths, mask, denominators))
    assert np.isclose(total, expected) and np.isclose(whole, expected)


def test_one_sample_per_rollout_is_the_classic_per_sample_mean():
    rng = np.random.default_rng(1)
    rollout_ids, lengths, mask, values, masks = random_batch(rng, [1] * 6)
    denominators = rollout_mask_sums(rollout_ids, masks)
    # The denominators are exactly the per-sample mask counts...
    assert denominators.tolist() == [int(m.sum()) for m in masks]
    per_rollout = sum_of_sample_contributions(values, lengths, mask, torch.tensor(denominators))
    offsets = np.concatenate([[0], np.cumsum(lengths.numpy())])
    classic = sum(
        (values[offsets[i]:offsets[i + 1]] * mask[offsets[i]:offsets[i + 1]]).sum() / mask[offsets[i]:offsets[i + 1]].sum().clamp(min=1)
        for i in range(6)
    )
    # ...so the loss is the per-sample mean (equal up to float summation order).
    assert torch.allclose(per_rollout, classic, rtol=1e-12, atol=0)


def test_a_four_sample_rollout_weighs_the_same_as_a_one_sample_rollout():
    # Every token has value 1: each rollout's mean is 1, whatever its sample count.
    lengths = torch.tensor([3, 3, 3, 3, 3])
    mask = torch.ones(15, dtype=torch.float64)
    rollout_ids = ["big"] * 4 + ["small"]
    denominators = torch.tensor(rollout_mask_sums(rollout_ids, [[1] * 3] * 5))
    values = torch.ones(15, dtype=torch.float64, requires_grad=True)
    total = sum_of_sample_contributions(values, lengths, mask, denominators)
    total.backward()
    assert total.item() == 2.0  # two rollouts, mean 1 each
    assert np.isclose(values.grad[:12].sum().item(), values.grad[12:].sum().item())


def test_clipped_policy_loss_clips_on_the_advantage_side():
    log_probs = torch.log(torch.tensor([1.5, 0.5, 1.0]))
    old = torch.zeros(3)
    adv = torch.tensor([1.0, -1.0, 2.0])
    losses, clipped = clipped_policy_loss(log_probs, old, adv, clip_eps=0.2)
    assert torch.allclose(losses, torch.tensor([-1.2, 0.8, -2.0]))
    assert clipped.tolist() == [1.0, 1.0, 0.0]
    assert token_advantages(torch.tensor([1.0, 2.0]), torch.tensor([2, 1])).tolist() == [1.0, 1.0, 2.0]


def test_count_weighted_reduction_differs_from_mean_of_means():
    rank0 = {"loss": (10.0, 10.0)}  # mean 1.0 over 10 tokens
    rank1 = {"loss": (3.0, 1.0)}  # mean 3.0 over 1 token
    reduced = reduce_metric_pairs([rank0, rank1])
    assert reduced == {"loss": (13.0, 11.0)}
    count_weighted = metric_values(reduced)["loss"]
    mean_of_means = np.mean([s / c for s, c in (rank0["loss"], rank1["loss"])])
    assert np.isclose(count_weighted, 13 / 11) and mean_of_means == 2.0 and count_weighted != mean_of_means
    pairs = {}
    add_metric(pairs, "reward", 2.0, 1)
    add_metric(pairs, "reward", 4.0, 3)
    assert metric_values(pairs) == {"reward": 1.5}
