"""A tool-using agent written as ordinary OpenAI-client code, trained through the job's endpoint.

The task: an addition question. The model may call a calculator by writing `calc(a,b)` in its
reply (plain text, parsed here: no `tool_calls`, so any chat template works), reads the tool's
result in the next turn, and answers `it is N.`. Nothing here imports the project: the function
gets a base URL and a key, as any OpenAI-client agent does, and returns its reward.

    python -m jobs.train --set rollout.endpoint.enabled=true \\
        --set rollout.agent=vgbs_ray.agents.openai_agent:make_agent \\
        --set rollout.agent_kwargs='{run: examples.calculator_agent:run}' \\
        --set rollout.prompts=examples.calculator_agent:make_prompts \\
        --set rollout.tokenizer_dir=DIR          # a checkpoint's tokenizer with a chat template

Reward: 1 for the right answer; otherwise partial credit for the digits of the right sum the
replies contain (a from-scratch policy gets a signal; docs/agents.md). With `compact_after=k`
the agent replaces its history by a one-message summary after k turns, as long-horizon agents
do: the job then trains that rollout as two samples under one rollout id. `transcript_path`
appends each rollout's turns (the engine's token ids, the tool's replies) as a JSON line.
"""

from __future__ import annotations

import json
import random
import re

from openai import OpenAI

CALL = re.compile(r"calc\((\d+),(\d+)\)")
ANSWER = re.compile(r"it is (\d+)")
SYSTEM = "Add with calc(a,b), then answer: it is N."


def make_prompts(seed: int = 0, max_operand: int = 19):
    """position -> {"a", "b"}: a pure function of the position (a resumed run asks the same questions)."""
    def prompt(position: int) -> dict:
        rng = random.Random(seed * 1_000_003 + position)
        return {"a": rng.randint(0, max_operand), "b": rng.randint(0, max_operand)}

    return prompt


def run(row: dict, base_url: str, api_key: str, max_turns: int = 3, max_tokens: int = 12,
        compact_after: int | None = None, transcript_path: str | None = None) -> float:
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    question = f"what is {row['a']} + {row['b']}?"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    expected, replies, turns = row["a"] + row["b"], [], []
    for turn in range(max_turns):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=max_tokens,
                                               extra_body={"return_token_ids": True})
        text = reply.choices[0].message.content
        replies.append(text)
        messages.append({"role": "assistant", "content": text})
        answer, call = ANSWER.search(text), CALL.search(text)
        if answer:
            turns.append({"token_ids": reply.choices[0].token_ids, "environment": None})
            break
        environment = (str(int(call.group(1)) + int(call.group(2))) if call
                       else "Use calc(a,b) or answer: it is N.")
        messages.append({"role": "tool" if call else "user", "content": environment})
        turns.append({"token_ids": reply.choices[0].token_ids, "environment": environment})
        if compact_after is not None and turn + 1 == compact_after:
            # Compaction: the history becomes one summary message (not an extension of what was sent).
            messages = [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": f"{question} So far: {environment}"}]
            turns[-1]["compacted"] = True
    if transcript_path is not None:
        with open(transcript_path, "a") as file:
            file.write(json.dumps({"base_url": base_url, "turns": turns}) + "\n")
    found = ANSWER.search(replies[-1])
    if found and int(found.group(1)) == expected:
        return 1.0
    digits = set(str(expected))
    return 0.1 * len(digits & set("".join(replies))) / len(digits)
