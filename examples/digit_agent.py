"""The demo's task as a user would write it: a multi-turn digit game, on the public agent API only.

    rollout.agent: examples.digit_agent:make_agent      (keyword arguments: rollout.agent_kwargs)
    rollout.prompts: examples.digit_agent:make_prompts
    rollout.tokenizer_dir: examples/digit_tokenizer     (python -m examples.digit_agent writes it)

The user says some digits; the right answer is one digit given by a rule of them (by default the
successor of the last digit, mod 10: the earlier digits are distractors). The model answers one
token. Right on turn t: reward `turn_rewards[t]`. Wrong: the user replies "higher", "lower" or
"not-digit" and the model tries again; a wrong last answer earns 0.

The tokenizer is a real Hugging Face tokenizer built in code (`build_tokenizer`: a word-level
vocabulary of the digits, the feedback words and three chat tokens) with a chat template, saved
as an ordinary tokenizer directory. A conversation renders as

    <|user|> 3 7 <|assistant|> 9 <|end|> <|user|> lower <|assistant|> 8

A retry is its own sample (`retry_as_new_sample`, the default): a new chat whose prompt is the whole
conversation so far, as agents that rebuild their context for each step do (a compaction, a sub-agent's
turn). So a rollout that needed a retry is two samples under one reward,

    <|user|> 3 7 <|assistant|> 9                                      (mask 1 on 9)
    <|user|> 3 7 <|assistant|> 9 <|end|> <|user|> lower <|assistant|> 8  (mask 1 on 8)

and a step of 64 rollouts holds 64 to 128 samples, more while the policy is wrong more often: the
variable batch the project is for. The loss weighs a rollout's tokens as one mean over all its samples,
so the gradient is the one the single-sample chat gives (`retry_as_new_sample=False`: one session that
appends only each turn's new tokens, the ids above in one sample): the model's answers (mask 1) and
everything else (mask 0, context).
"""

from __future__ import annotations

import argparse

import numpy as np

from vgbs_ray.agents import AgentResult, RolloutContext, SamplingConfig

DIGITS = [str(d) for d in range(10)]
FEEDBACK = ["higher", "lower", "not-digit"]
USER, ASSISTANT, END, PAD = "<|user|>", "<|assistant|>", "<|end|>", "<pad>"
VOCABULARY = DIGITS + [USER, ASSISTANT, END] + FEEDBACK + [PAD]
"""Token id = position: the digits are ids 0..9."""
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|> {{ m['content'] }} <|end|> "
    "{% else %}<|user|> {{ m['content'] }} {% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
"""Every role is rendered: assistant turns as the policy's, every other (user, system, tool) as input after
<|user|> (the vocabulary has no marker of its own for them)."""

RULES = {
    "successor_of_last": lambda digits: (digits[-1] + 1) % 10,
    "first": lambda digits: digits[0],
    "largest": max,
    "sum_mod_10": lambda digits: sum(digits) % 10,
}


def build_tokenizer():
    """The task's tokenizer (transformers' PreTrainedTokenizerFast over a `tokenizers` WordLevel model)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({word: i for i, word in enumerate(VOCABULARY)}, unk_token=PAD))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=END, unk_token=PAD,
                                        additional_special_tokens=[USER, ASSISTANT])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_prompts(seed: int, min_digits: int = 1, max_digits: int = 3, rule: str = "successor_of_last"):
    """Prompt rows as a pure function of (seed, position): the same rows after every resume."""
    if rule not in RULES:
        raise ValueError(f"rule={rule!r} is unknown; pick one of {sorted(RULES)}")

    def prompt(position: int) -> dict:
        rng = np.random.default_rng([seed, position])
        digits = [int(d) for d in rng.integers(0, 10, int(rng.integers(min_digits, max_digits + 1)))]
        return {"digits": digits, "answer": RULES[rule](digits)}

    return prompt


def make_agent(turn_rewards: tuple[float, ...] = (1.0, 0.5), rule: str = "successor_of_last",
               retry_as_new_sample: bool = True):
    """The agent: one answer token per turn, feedback after a wrong one, `len(turn_rewards)` turns; each retry a
    sample of its own (see module docstring) unless `retry_as_new_sample` is false."""
    if rule not in RULES:
        raise ValueError(f"rule={rule!r} is unknown; pick one of {sorted(RULES)}")
    turn_rewards = tuple(float(r) for r in turn_rewards)
    answer_one_token = SamplingConfig(max_tokens=1, temperature=1.0)

    async def agent(row: dict, ctx: RolloutContext) -> AgentResult:
        digits = [int(d) for d in row["digits"]]
        expected = RULES[rule](digits)
        chat = ctx.chat([{"role": "user", "content": " ".join(map(str, digits))}])
        for turn, reward in enumerate(turn_rewards):
            answer = (await chat.generate(answer_one_token)).strip()
            if answer == str(expected):
                return AgentResult(reward=reward, metrics={"turns": turn + 1})
            if turn + 1 < len(turn_rewards):
                feedback = ("not-digit" if answer not in DIGITS else "higher" if expected > int(answer) else "lower")
                chat.messages.append({"role": "user", "content": feedback})
                if retry_as_new_sample:  # the next turn is a new sample whose prompt is the whole conversation
                    chat = ctx.chat(chat.messages)
        return AgentResult(reward=0.0, metrics={"turns": len(turn_rewards)})

    return agent


def max_sequence_length(max_digits: int = 3, turns: int = 2) -> int:
    """Longest conversation in tokens: <|user|> digits <|assistant|> a, then per retry <|end|> <|user|> f <|assistant|> a."""
    return max_digits + 3 + 4 * (turns - 1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write the digit task's tokenizer directory.")
    parser.add_argument("directory", nargs="?", default="examples/digit_tokenizer")
    build_tokenizer().save_pretrained(parser.parse_args().directory)
