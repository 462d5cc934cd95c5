"""Helpers for the agent tests: a byte-level BPE chat tokenizer made in code, and a scripted engine.

`scripted_engine(replies)` is the engine side of a RolloutContext for tests of the session logic
without a cluster: it answers each request with the next scripted token ids and records what it
was given, so a test can compare the trained tokens with exactly what the "engine" saw and said.
The real engine path (vLLM, Ray) is covered by the job tests.
"""

from __future__ import annotations

import numpy as np

from vgbs_ray.agents import Generation

QWEN_LIKE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DROPS_EARLIER_REASONING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1] }}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Like several reasoning models' templates: earlier assistant turns lose their <think> part."""


def bpe_chat_tokenizer(template: str = QWEN_LIKE_TEMPLATE):
    """A small byte-level BPE tokenizer with ChatML special tokens (trained here, nothing downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    lines = [f"user: what is {a} + {b}? assistant: <think>{a} plus {b}</think> it is {a + b}. tool: calc({a},{b})"
             for a in range(20) for b in range(0, 20, 3)]
    core.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<pad>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<|im_end|>",
                                        additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = template
    return tokenizer


class ScriptedEngine:
    """Answers request k with `replies[k]` (token ids); records every prompt it was given."""

    def __init__(self, replies, *, policy_version: int = 3):
        self.replies = [list(r) for r in replies]
        self.prompts: list[list[int]] = []
        self.policy_version = policy_version

    async def __call__(self, token_ids, sampling) -> Generation:
        reply = self.replies[len(self.prompts)]
        self.prompts.append(list(token_ids))
        finish = "stop" if reply and reply[-1] in sampling.stop_token_ids else "length"
        return Generation(prompt_token_ids=np.asarray(token_ids, dtype=np.int64),
                          response_token_ids=np.asarray(reply, dtype=np.int64),
                          response_log_probs=-0.1 * np.arange(1, len(reply) + 1, dtype=np.float32),
                          policy_version=self.policy_version, finish_reason=finish, engine="scripted")


def make_flaky_agent(fail_every: int):
    """The digit agent, except that every `fail_every`-th prompt (by its digits' position) raises."""
    from examples.digit_agent import make_agent

    digit_agent = make_agent()

    async def agent(row, ctx):
        if int(str(ctx.group_id)[1:]) % fail_every == 0:
            raise RuntimeError(f"flaky tool failed on {ctx.group_id}")
        return await digit_agent(row, ctx)

    return agent


def make_repeated_agent(samples: int = 4):
    """The digit agent's first turn asked `samples` times in one rollout, each in a chat of its own (one sample
    each): rollouts of `samples` samples, rewarded by the share answered right (multi-LoRA fairness tests)."""
    from examples.digit_agent import RULES
    from vgbs_ray.agents import AgentResult, SamplingConfig

    one_token = SamplingConfig(max_tokens=1, temperature=1.0)

    async def agent(row, ctx):
        digits = [int(d) for d in row["digits"]]
        expected = str(RULES["successor_of_last"](digits))
        right = 0
        for _ in range(samples):
            chat = ctx.chat([{"role": "user", "content": " ".join(map(str, digits))}])
            right += (await chat.generate(one_token)).strip() == expected
        return AgentResult(reward=right / samples)

    return agent


def make_failing_agent():
    """An agent that raises on every rollout (a tenant whose agent is broken)."""

    async def agent(row, ctx):
        raise RuntimeError(f"broken agent on {ctx.group_id}")

    return agent
