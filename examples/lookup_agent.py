"""A function-calling agent where the tool is the only way to the reward, on the OpenAI client.

    python -m jobs.train --preset tool_use        # rollout.endpoint.tool_parser=hermes, this agent

The user asks for a secret digit that nothing in the conversation predicts (a fresh draw per prompt row);
the tool `lookup` returns it. The agent offers the tool (`tools=[LOOKUP]`) and asks for one token per reply:
- a first reply the endpoint returns as a call (`tool_calls`, parsed from the engine's text by vLLM's `hermes`
  parser) gets the tool's result, and the next reply is the answer; a wrong digit gets "higher" or "lower"
  and one more try;
- any other first reply is the answer itself (a guess).
Reward: 1.0 for the secret on the first answer, 0.5 on the second; 0.2 for a lookup followed by digits that
were never right (credit for the call's form, so a policy that calls is told apart from one that does not before
it can copy); 1.0 for a lucky guess, 0 for anything else. A random policy earns ~0.1 (chance); a policy that always looks the secret up and copies it
earns 1.0. The rollout's metric `called` (1 when the first reply was a parsed call) is its share of valid calls.

The tokenizer (`build_tokenizer`, saved in examples/lookup_tokenizer) is word-level, like the digit task's,
and holds the whole hermes call as one vocabulary word,
`<tool_call>{"name":"lookup","arguments":{}}</tool_call>`: a 0.3M model from scratch samples it once in
~20 replies, so RL can find it. (In a pure-torch trial a call spelled over three tokens, `<tool_call>` / the
JSON / `</tool_call>`, with credit per right token, took ~130 steps to be 90% of first replies against ~35 for
the one word; where the turn also had to end with `<|end|>`, runs collapsed after the first two tokens.) The engine's token is real output; the endpoint decodes it and vLLM's parser reads the call from
that text, as for any hermes model.

Nothing here imports the project but `async_openai_client` (one `AsyncOpenAI` per process, pointed at each
rollout's session) and `report_reward` (a POST to the session's reward URL, with the metric).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random

from vgbs_ray.agents.openai_agent import async_openai_client, report_reward

DIGITS = [str(d) for d in range(10)]
CALL = '<tool_call>{"name":"lookup","arguments":{}}</tool_call>'
QUESTION, HIGHER, LOWER = "secret?", "higher", "lower"
USER, ASSISTANT, TOOL, END, PAD = "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>", "<pad>"
VOCABULARY = DIGITS + [USER, ASSISTANT, TOOL, END, CALL, QUESTION, HIGHER, LOWER, PAD]
"""Token id = position: the digits are ids 0..9."""
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|> {{ m['content'] }} <|end|> "
    "{% elif m['role'] == 'tool' %}<|tool|> {{ m['content'] }} "
    "{% else %}<|user|> {{ m['content'] }} {% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
"""Every role rendered; an assistant turn as its content (the endpoint sends back the engine's own text of a call,
so a call renders as the call word). The tools' schemas are not rendered: the task has one tool and the model
learns its call from the reward."""

LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "The secret digit.",
    "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}

ANSWER_REWARDS = (1.0, 0.5)
"""Reward for the secret on the first answer after the lookup, on the second."""
CALLED_CREDIT = 0.2
"""Reward of a lookup whose answers were digits, never the secret."""


def build_tokenizer():
    """The task's tokenizer (transformers' PreTrainedTokenizerFast over a `tokenizers` WordLevel model)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({word: i for i, word in enumerate(VOCABULARY)}, unk_token=PAD))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=END, unk_token=PAD,
                                        additional_special_tokens=[USER, ASSISTANT, TOOL])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_prompts(seed: int = 0):
    """position -> {"secret"}: a pure function of the position (a resumed run asks the same questions)."""
    def prompt(position: int) -> dict:
        return {"secret": random.Random(seed * 1_000_003 + position).randrange(10)}

    return prompt


async def run(row: dict, base_url: str, api_key: str, record_path: str | None = None,
              called_credit: float = CALLED_CREDIT) -> None:
    """One rollout (async: the producer runs it on its event loop, no thread per rollout). `called_credit`:
    the reward of a lookup whose answers were digits, never the secret (a run's `run_kwargs` may raise it)."""
    client = async_openai_client(base_url, api_key)  # one HTTP client per process, not one per rollout
    secret = str(row["secret"])
    messages = [{"role": "user", "content": QUESTION}]

    async def reply():
        response = await client.chat.completions.create(model="policy", messages=messages, tools=[LOOKUP],
                                                         max_tokens=1)
        return response, response.choices[0].message

    response, message = await reply()
    version = response.system_fingerprint  # "policy-v{N}": the policy that sampled the first reply
    called = bool(message.tool_calls)
    if not called:
        reward = 1.0 if (message.content or "").strip() == secret else 0.0
    else:
        reward = 0.0
        messages += [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": secret}]
        for answer_reward in ANSWER_REWARDS:
            _, answer = await reply()
            text = (answer.content or "").strip() if not answer.tool_calls else ""
            if text not in DIGITS:
                reward = 0.0  # a second call, or a word: no answer
                break
            if text == secret:
                reward = answer_reward
                break
            reward = called_credit
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": HIGHER if int(secret) > int(text) else LOWER}]
    if record_path is not None:
        with open(record_path, "a") as file:
            file.write(json.dumps({"version": version, "called": called, "reward": reward}) + "\n")
    await asyncio.to_thread(report_reward, base_url, api_key, reward, {"called": float(called)})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write the lookup task's tokenizer directory.")
    parser.add_argument("directory", nargs="?", default="examples/lookup_tokenizer")
    build_tokenizer().save_pretrained(parser.parse_args().directory)
