"""The digit task: prompt streams that resume, the multi-turn episode, its samples and its chance reward."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.digit_env.digits import (BOS, HIGHER, LOWER, NOT_DIGIT, SEP, VOCAB_SIZE, DigitTaskConfig, PromptCursor,
                                  PromptGenerator, prompt_at, prompt_from_row, prompt_rows, rollout_id_for)
from benchmarks.digit_env.episode import DigitEpisode, EpisodeError, EpisodeGroup
from vgbs_ray.errors import ConfigError
from vgbs_ray.layout.microbatch import pack_micro_batch
from vgbs_ray.losses.loading import build_loss
from vgbs_ray.losses.reduction import micro_batch_loss
from vgbs_ray.sample import Sample, validate_rollout
from vgbs_ray.layout.shard import single_micro_batch_shard

TASK = DigitTaskConfig()


def test_prompts_are_pure_functions_of_seed_and_index():
    a, b = prompt_at(TASK, 3, 17), prompt_at(TASK, 3, 17)
    assert a == b and a.prompt_id == "s3-p17" and rollout_id_for(a, 5) == "s3-p17-r5"
    assert a.tokens.tolist() == [BOS, *a.digits, SEP]
    prompts = [prompt_at(TASK, 0, i) for i in range(200)]
    assert {len(p.digits) for p in prompts} == {1, 2, 3}
    assert all(p.answer == (p.digits[-1] + 1) % 10 for p in prompts)
    assert len({p.digits for p in prompts}) > 100  # not a handful repeated
    assert [p.digits for p in prompts[:20]] != [prompt_at(TASK, 1, i).digits for i in range(20)]


def test_a_restored_cursor_yields_the_same_prompts_and_rollout_ids():
    original = PromptGenerator(TASK, PromptCursor(seed=9))
    for _ in range(7):
        next(original)
    saved = PromptCursor.from_dict(original.cursor.to_dict())
    assert saved == PromptCursor(seed=9, next_index=7)
    resumed = PromptGenerator(TASK, saved)
    expected = [next(original) for _ in range(5)]
    again = [next(resumed) for _ in range(5)]
    assert again == expected
    assert [rollout_id_for(p, 0) for p in again] == [f"s9-p{i}-r0" for i in range(7, 12)]


def test_prompt_rows_round_trip_and_refuse_another_rule():
    rows = prompt_rows(TASK, seed=2, start=4, count=3)
    assert [prompt_from_row(TASK, r) for r in rows] == [prompt_at(TASK, 2, i) for i in range(4, 7)]
    first_rule = DigitTaskConfig(rule="first")
    bad = next(r for r in rows if r["digits"][0] != r["answer"])
    with pytest.raises(ValueError, match=r"s2-p\d+: answer .* disagrees with rule 'first'"):
        prompt_from_row(first_rule, bad)


@pytest.mark.parametrize("field, value, match", [
    ("rule", "nope", "rule='nope' is unknown"),
    ("min_digits", 0, "min_digits"),
    ("turn_rewards", (), "at least one"),
    ("turn_rewards", (1.0, 2.0), r"\[0, 1\]"),
])
def test_task_config_names_the_bad_field(field, value, match):
    with pytest.raises(ConfigError, match=match):
        DigitTaskConfig(**{field: value})


def play(prompt, answers, versions=None):
    episode = DigitEpisode(TASK, prompt)
    for turn, answer in enumerate(answers):
        episode.submit([answer], [-0.5 - turn], (versions or [0] * len(answers))[turn])
    return episode


def test_right_at_once_ends_with_full_reward_and_one_sample():
    prompt = prompt_at(TASK, 0, 0)
    episode = play(prompt, [prompt.answer])
    assert episode.done and episode.reward == 1.0 and len(episode.turns) == 1
    rows = episode.to_samples("x", group_id=prompt.prompt_id, group_size=8)
    assert len(rows) == 1 and rows[0]["tokens"].tolist() == [*prompt.tokens, prompt.answer]


@pytest.mark.parametrize("wrong, feedback", [(None, None), (12, NOT_DIGIT)])
def test_a_wrong_answer_gets_feedback_and_a_retry(wrong, feedback):
    prompt = next(p for p in (prompt_at(TASK, 0, i) for i in range(50)) if 0 < p.answer < 9)
    if wrong is None:  # a digit below the answer: the environment says "higher"
        wrong, feedback = prompt.answer - 1, HIGHER
    episode = play(prompt, [wrong])
    assert not episode.done and episode.turns[0].feedback == feedback
    assert episode.context().tolist() == [*prompt.tokens, wrong, feedback]
    episode.submit([prompt.answer], [-0.1], 1)
    assert episode.done and episode.reward == 0.5
    lower = play(prompt, [prompt.answer + 1])
    assert lower.turns[0].feedback == LOWER


def test_wrong_twice_earns_nothing_and_misuse_is_named():
    prompt = prompt_at(TASK, 0, 1)
    wrong = (prompt.answer + 3) % 10
    episode = play(prompt, [wrong, wrong])
    assert episode.done and episode.reward == 0.0 and episode.turns[-1].feedback is None
    with pytest.raises(EpisodeError, match="s0-p1.*over"):
        episode.context()
    with pytest.raises(EpisodeError, match="s0-p1, turn 3: submit after the episode ended"):
        episode.submit([1], [-1.0], 0)
    fresh = DigitEpisode(TASK, prompt)
    with pytest.raises(EpisodeError, match="turn 1: expected 1 response token"):
        fresh.submit([1, 2], [-1.0, -1.0], 0)
    with pytest.raises(EpisodeError, match="before the episode ended"):
        fresh.to_samples("x")


def test_samples_per_turn_and_transcript_are_valid_rollouts_with_versions():
    prompt = prompt_at(TASK, 0, 2)
    wrong = (prompt.answer + 5) % 10
    episode = play(prompt, [wrong, prompt.answer], versions=[3, 4])
    per_turn = [Sample.from_dict(r) for r in episode.to_samples("r1", group_id="g", group_size=8)]
    validate_rollout(per_turn)
    assert [s.response_length for s in per_turn] == [1, 1] and {s.reward for s in per_turn} == {0.5}
    assert [(s.policy_version_min, s.policy_version_max) for s in per_turn] == [(3, 3), (4, 4)]
    assert per_turn[1].tokens.tolist() == [*prompt.tokens, wrong, episode.turns[0].feedback, prompt.answer]
    (whole,) = [Sample.from_dict(r) for r in episode.to_samples("r1", one_sample_per_turn=False)]
    validate_rollout([whole])
    assert whole.loss_mask.tolist() == [1, 0, 1] and whole.rollout_log_probs.tolist() == [-0.5, 0.0, -1.5]
    assert (whole.policy_version_min, whole.policy_version_max) == (3, 4)
    assert whole.tokens.tolist() == per_turn[1].tokens.tolist()


def test_an_episode_group_drives_its_members_and_yields_grouped_rollouts():
    prompt = prompt_at(TASK, 4, 0)
    group = EpisodeGroup(TASK, prompt, group_size=3)
    assert group.rollout_ids == ["s4-p0-r0", "s4-p0-r1", "s4-p0-r2"]
    wrong = (prompt.answer + 2) % 10
    for turn in range(TASK.max_turns):
        live = group.live()
        for (rollout_id, episode) in live:  # r0 right at once, r1 right on retry, r2 never
            right = rollout_id.endswith("r0") or (rollout_id.endswith("r1") and turn == 1)
            episode.submit([prompt.answer if right else wrong], [-1.0], turn)
    assert group.done and group.live() == []
    assert group.rewards() == {"s4-p0-r0": 1.0, "s4-p0-r1": 0.5, "s4-p0-r2": 0.0}
    rows = group.to_samples()
    assert [r["rollout_id"] for r in rows] == ["s4-p0-r0", "s4-p0-r1", "s4-p0-r1", "s4-p0-r2", "s4-p0-r2"]
    assert {(r["group_id"], r["group_size"]) for r in rows} == {("s4-p0", 3)}


def test_uniform_policy_earns_the_chance_reward_and_fits_the_length_bound():
    rng = np.random.default_rng(0)
    rewards, longest = [], 0
    for i in range(4000):
        episode = DigitEpisode(TASK, prompt_at(TASK, 5, i))
        while not episode.done:
            episode.submit([int(rng.integers(VOCAB_SIZE))], [-np.log(VOCAB_SIZE)], 0)
        rewards.append(episode.reward)
        longest = max(longest, max(len(r["tokens"]) for r in episode.to_samples("x", one_sample_per_turn=False)))
    chance = TASK.chance_reward()
    assert 0.05 < chance < 0.15  # "well below 0.5"
    assert abs(np.mean(rewards) - chance) < 4 * np.std(rewards) / np.sqrt(len(rewards))
    assert longest == TASK.max_sequence_length


class CausalGRU(torch.nn.Module):
    """A tiny causal model: the log-prob of each next token depends only on earlier tokens."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB_SIZE, 16)
        self.gru = torch.nn.GRU(16, 16, batch_first=True)
        self.head = torch.nn.Linear(16, VOCAB_SIZE)

    def response_log_probs(self, micro_batch):
        """Flat response-token log-probs of a packed micro-batch, one sequence at a time."""
        parts, tokens = [], micro_batch.tokens[0]
        for start, end, response in zip(micro_batch.cu_seqlens[:-1].tolist(), micro_batch.cu_seqlens[1:].tolist(),
                                        micro_batch.response_lengths.tolist()):
            hidden, _ = self.gru(self.embed(tokens[start:end]).unsqueeze(0))
            log_probs = torch.log_softmax(self.head(hidden[0]), dim=-1)
            positions = torch.arange(end - start - response, end - start)
            parts.append(log_probs[positions - 1, tokens[start:end][positions]])
        return torch.cat(parts)


def test_both_sample_formats_give_the_same_per_rollout_loss():
    """Compaction into one sample per turn or one transcript sample: same loss, same gradient."""
    model = CausalGRU()
    episodes = []
    for i in range(6):
        prompt = prompt_at(TASK, 1, i)
        answers = [prompt.answer] if i % 3 == 0 else [(prompt.answer + 1 + i) % 10] + ([prompt.answer] if i % 3 == 1 else [4])
        episodes.append((f"r{i}", play(prompt, answers[:2])))

    def loss_and_grad(one_sample_per_turn):
        samples = [Sample.from_dict(row).with_advantage(episode.reward - 0.4) for rid, episode in episodes
                   for row in episode.to_samples(rid, one_sample_per_turn=one_sample_per_turn)]
        shard = single_micro_batch_shard(samples)
        micro_batch = pack_micro_batch(shard, range(shard.num_samples))
        model.zero_grad()
        log_probs = model.response_log_probs(micro_batch)
        loss, _ = micro_batch_loss(build_loss("ppo"), log_probs, micro_batch,
                                   behaviour_log_probs=log_probs.detach() - 0.05)
        loss.backward()
        return loss.detach(), model.head.weight.grad.clone(), shard.num_samples

    per_turn, transcript = loss_and_grad(True), loss_and_grad(False)
    assert per_turn[2] > transcript[2] == len(episodes)  # different sample counts ...
    torch.testing.assert_close(per_turn[0], transcript[0], rtol=1e-5, atol=1e-7)  # ... one loss
    torch.testing.assert_close(per_turn[1], transcript[1], rtol=1e-4, atol=1e-7)
    assert per_turn[0].abs() > 1e-4
