"""How fast a from-scratch tiny Llama learns the digit task by GRPO: the margin a learning test needs.

    .venv/bin/python benchmarks/bench_env_learning.py [--quick] [--seeds 0 1 2 3 4]
    .venv/bin/python benchmarks/bench_env_learning.py --losses [ppo gspo ...]   # the policy losses side by side

Pure torch on one thread, no Ray, no Megatron, no vLLM, but the project's own data path:
the multi-turn environment (`benchmarks.digit_env`) makes the samples (one per turn, so rollouts
have 1 or 2), `vgbs_ray.losses.advantages` normalises rewards per GRPO group, uniform groups are
dropped (dynamic sampling, so each step trains a different number of rollouts), the samples
become a `StepShard` and a `PackedMicroBatch`, and `vgbs_ray.losses.reduction.micro_batch_loss`
computes the per-rollout loss divided by the step's rollout count. One optimizer step per
step, like the trainer.

Staleness is emulated at its worst: with staleness s, every rollout of step k is sampled by
the weights of version k - s (a snapshot), and the loss is decoupled PPO (proximal = the
weights at step start, truncated importance weights); s = 0 is on-policy PPO. With --losses, each
named loss at staleness 0 and 2 (a loss without its own correction gets TIS against the proximal
policy when stale; `gspo@behaviour`: GSPO's sequence ratio against the stale sampling policy itself,
uncorrected, as its paper runs it).

Printed per configuration, side by side over seeds: steps until the mean reward over the
last 10 steps first reaches 0.8, the mean reward of the first 10 steps (chance), the last
10, and seconds of wall time. The model mirrors the tiny default policy: Llama blocks
(RMSNorm, RoPE, SwiGLU, no biases, untied head), hidden 128, 4 heads (head_dim 32), init std 0.02.
"""

from __future__ import annotations

import argparse
import collections
import copy
import math
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from vgbs_ray.losses.advantages import group_advantages, is_uniform_group
from benchmarks.digit_env.digits import PAD, VOCAB_SIZE, DigitTaskConfig, PromptCursor, PromptGenerator
from benchmarks.digit_env.episode import EpisodeGroup
from vgbs_ray.layout.microbatch import pack_micro_batch
from vgbs_ray.losses import CorrectionConfig
from vgbs_ray.losses.loading import ResolvedLoss, build_loss
from vgbs_ray.losses.reduction import micro_batch_loss
from vgbs_ray.sample import Sample, validate_rollout
from vgbs_ray.layout.shard import single_micro_batch_shard

HIDDEN, LAYERS, HEADS, FFN = 128, 2, 4, 256
LR = 1e-3
CLIP_GRAD_NORM = 1.0  # the trainer's default (OptimizerConfig.clip_grad_norm)
GROUP_SIZE = 8
TARGET_REWARD, WINDOW_STEPS = 0.8, 10
MAX_STEPS = 300
LOSSES = ("ppo", "decoupled_ppo", "gspo", "cispo", "dr_grpo")
"""--losses: the policy losses compared (docs/losses.md), each at staleness 0 and 2."""
LOSS_KWARGS = {"dr_grpo": {"max_response_tokens": 2}}
"""The digit task's answers are 1-2 tokens per turn: Dr. GRPO's constant is that budget."""

# (label, task rule, prompts per step, staleness); gbs = prompts x GROUP_SIZE rollouts before the filter.
CONFIGS = [
    ("successor, 8 prompts, on-policy", "successor_of_last", 8, 0),
    ("successor, 4 prompts, on-policy", "successor_of_last", 4, 0),
    ("successor, 16 prompts, on-policy", "successor_of_last", 16, 0),
    ("successor, 8 prompts, stale 1", "successor_of_last", 8, 1),
    ("successor, 8 prompts, stale 2", "successor_of_last", 8, 2),
    ("successor, 16 prompts, stale 2", "successor_of_last", 16, 2),
    ("first digit, 8 prompts, on-policy", "first", 8, 0),
    ("sum mod 10 (hard control)", "sum_mod_10", 8, 0),
]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(HIDDEN, eps=1e-6), nn.RMSNorm(HIDDEN, eps=1e-6)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.out = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.gate_up = nn.Linear(HIDDEN, 2 * FFN, bias=False)
        self.down = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x, cos, sin):
        b, length, _ = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, length, 3, HEADS, HIDDEN // HEADS).permute(2, 0, 3, 1, 4)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # right padding never reaches real tokens
        x = x + self.out(attn.transpose(1, 2).reshape(b, length, HIDDEN))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class TinyLlama(nn.Module):
    def __init__(self, max_length: int):
        super().__init__()
        self.embed = nn.Embedding(VOCAB_SIZE, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(HIDDEN, eps=1e-6)
        self.head = nn.Linear(HIDDEN, VOCAB_SIZE, bias=False)
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)
        head_dim = HIDDEN // HEADS
        inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(max_length).float(), inv_freq).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens):  # [B, L] -> [B, L, V]
        length = tokens.shape[1]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.cos[:length], self.sin[:length])
        return self.head(self.norm(x))


def _padded(sequences: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([len(s) for s in sequences])
    batch = torch.full((len(sequences), int(lengths.max())), PAD, dtype=torch.long)
    for i, s in enumerate(sequences):
        batch[i, :len(s)] = torch.from_numpy(s)
    return batch, lengths


@torch.no_grad()
def sample_answers(model, contexts, generator) -> tuple[list[int], list[float]]:
    """One token after each context, sampled at temperature 1 over the whole vocabulary (as an engine does)."""
    batch, lengths = _padded(contexts)
    logits = model(batch)[torch.arange(len(contexts)), lengths - 1]
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    tokens = torch.multinomial(log_probs.exp(), 1, generator=generator).squeeze(1)
    return tokens.tolist(), log_probs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()


def response_log_probs(model, shard) -> torch.Tensor:
    """Flat log-probs of the shard's response tokens, in sample order (the micro-batch's layout)."""
    offsets = shard.token_offsets()
    sequences = [shard.token_ids[offsets[i]:offsets[i + 1]] for i in range(shard.num_samples)]
    batch, lengths = _padded(sequences)
    log_probs = torch.log_softmax(model(batch).float(), dim=-1)
    parts = []
    for i, (length, response) in enumerate(zip(lengths.tolist(), shard.response_lengths.tolist())):
        positions = torch.arange(length - response, length)
        parts.append(log_probs[i, positions - 1, batch[i, positions]])
    return torch.cat(parts)


@dataclass
class RunResult:
    steps_to_target: int | None
    first_mean: float
    last_mean: float
    wall_s: float
    trained_rollouts: int


def loss_for(name: str | None, staleness: int) -> ResolvedLoss:
    """The loss a configuration trains with: decoupled PPO when stale and ppo on-policy unless named; a named
    loss without its own correction gets TIS against the proximal policy when stale (no uncorrected runs)."""
    if name is None:
        name = "decoupled_ppo" if staleness else "ppo"
    if name == "gspo@behaviour":  # GSPO as its paper runs it: the sequence ratio against the sampling policy
        return build_loss("gspo", {}, max_staleness=staleness, allow_uncorrected_staleness=True)
    kwargs = dict(LOSS_KWARGS.get(name, {}))
    correction = CorrectionConfig()
    if staleness and name in ("ppo", "gspo", "dr_grpo", "dapo"):
        kwargs["anchor"] = "proximal"
        correction = CorrectionConfig(kind="tis", high=2.0)
    return build_loss(name, kwargs, correction=correction, max_staleness=staleness)


def run(rule: str, prompts_per_step: int, staleness: int, seed: int, max_steps: int, lr: float = LR,
        loss_name: str | None = None) -> RunResult:
    torch.manual_seed(seed)
    task = DigitTaskConfig(rule=rule)
    model = TinyLlama(task.max_sequence_length)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    policy_loss = loss_for(loss_name, staleness)
    prompts = PromptGenerator(task, PromptCursor(seed=seed))
    generator = torch.Generator().manual_seed(seed)
    snapshots = collections.deque([copy.deepcopy(model)], maxlen=staleness + 1)  # versions k - s .. k
    rewards, trained, start = [], 0, time.perf_counter()
    for step in range(max_steps):
        behaviour = snapshots[0]  # the oldest kept version: k - s once the deque is full
        groups = [EpisodeGroup(task, next(prompts), group_size=GROUP_SIZE) for _ in range(prompts_per_step)]
        while live := [episode for group in groups for _, episode in group.live()]:
            answers, log_probs = sample_answers(behaviour, [e.context() for e in live], generator)
            for episode, answer, log_prob in zip(live, answers, log_probs):
                episode.submit([answer], [log_prob], max(step - staleness, 0))
        rewards.append(statistics.fmean(r for group in groups for r in group.rewards().values()))
        samples = []
        for group in groups:
            if is_uniform_group(list(group.rewards().values())):
                continue  # dynamic sampling: no signal
            advantages = group_advantages(group.rewards())
            built = [Sample.from_dict(row) for row in group.to_samples()]
            for rollout_id in group.rollout_ids:
                validate_rollout([s for s in built if s.rollout_id == rollout_id])
            samples += [s.with_advantage(advantages[s.rollout_id]) for s in built]
        if samples:
            shard = single_micro_batch_shard(samples, step)
            micro_batch = pack_micro_batch(shard, range(shard.num_samples))
            # One update per step: the proximal policy is this forward's own, detached (micro_batch_loss's default);
            # the micro-batch holds every rollout whole, so GSPO's rollout log-ratio is formed in it.
            loss, _ = micro_batch_loss(policy_loss, response_log_probs(model, shard), micro_batch,
                                       behaviour_log_probs=micro_batch.old_log_probs)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_GRAD_NORM)
            optimizer.step()
            trained += shard.num_rollouts
        snapshots.append(copy.deepcopy(model))
        if len(rewards) >= WINDOW_STEPS and statistics.fmean(rewards[-WINDOW_STEPS:]) >= TARGET_REWARD:
            break
    reached = len(rewards) if statistics.fmean(rewards[-WINDOW_STEPS:]) >= TARGET_REWARD else None
    return RunResult(reached, statistics.fmean(rewards[:WINDOW_STEPS]), statistics.fmean(rewards[-WINDOW_STEPS:]),
                     time.perf_counter() - start, trained)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--max-steps", type=int, default=MAX_STEPS)
    parser.add_argument("--quick", action="store_true", help="two seeds, the first two configurations")
    parser.add_argument("--lr", type=float, default=LR)
    parser.add_argument("--only", default="", help="run only configurations whose label contains this")
    parser.add_argument("--losses", nargs="*", default=None,
                        help=f"compare policy losses instead (default {' '.join(LOSSES)}) at staleness 0 and 2, "
                             "8 prompts of the successor rule")
    args = parser.parse_args()
    torch.set_num_threads(1)
    configs = [(label, rule, prompts, staleness, None) for label, rule, prompts, staleness in CONFIGS]
    configs = [c for c in (configs[:2] if args.quick else configs) if args.only in c[0]]
    if args.losses is not None:
        configs = [(f"{name}, stale {staleness}", "successor_of_last", 8, staleness, name)
                   for name in (args.losses or LOSSES) for staleness in (0, 2)]
        if not args.losses:
            configs.append(("gspo@behaviour, stale 2", "successor_of_last", 8, 2, "gspo@behaviour"))
    seeds = args.seeds[:2] if args.quick else args.seeds
    task = DigitTaskConfig()
    print(f"digit task: vocab {VOCAB_SIZE}, max sequence {task.max_sequence_length} tokens, turn rewards "
          f"{task.turn_rewards}, chance reward {task.chance_reward():.3f}; model {LAYERS}x{HIDDEN}, {HEADS} heads; "
          f"Adam {args.lr}, clip {CLIP_GRAD_NORM}; groups of {GROUP_SIZE}; target: mean reward >= {TARGET_REWARD} over {WINDOW_STEPS} steps")
    print(f"{'configuration':36} {'steps to target per seed':>30} {'median':>7} {'first10':>8} {'last10':>7} "
          f"{'rollouts':>9} {'s/run':>6}")
    for label, rule, prompts, staleness, loss_name in configs:
        results = [run(rule, prompts, staleness, seed, args.max_steps, args.lr, loss_name) for seed in seeds]
        steps = [r.steps_to_target for r in results]
        shown = " ".join(str(s) if s is not None else f">{args.max_steps}" for s in steps)
        median = statistics.median(s if s is not None else math.inf for s in steps)
        print(f"{label:36} {shown:>30} {median:>7} {statistics.fmean(r.first_mean for r in results):8.2f} "
              f"{statistics.fmean(r.last_mean for r in results):7.2f} "
              f"{statistics.fmean(r.trained_rollouts for r in results):9.0f} "
              f"{statistics.fmean(r.wall_s for r in results):6.1f}", flush=True)


if __name__ == "__main__":
    main()
