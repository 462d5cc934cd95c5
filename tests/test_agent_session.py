"""Sessions are token-exact: what a sample trains is what the engine was given and what it returned.

With real Hugging Face tokenizers made in code (the demo's word-level one and a byte-level BPE with
a ChatML template) and a scripted engine: every trained sample's ids are the prompt rendering, then
the engine's outputs and the environment's suffixes in order, unchanged; the loss mask is 1 exactly
on the engine's tokens; a template that is not append-only starts a second sample of the rollout.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from examples.digit_agent import build_tokenizer
from tests.agent_support import DROPS_EARLIER_REASONING_TEMPLATE, ScriptedEngine, bpe_chat_tokenizer
from vgbs_ray.agents import RolloutContext, SamplingConfig, SessionError
from vgbs_ray.sample import Sample, validate_sample


def context(engine, tokenizer=None, **kwargs) -> RolloutContext:
    return RolloutContext(rollout_id="q7-r0", group_id="q7", member=0, group_size=2, engine_generate=engine,
                          tokenizer=tokenizer, **kwargs)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def check_rows_are_exact(rows, engine, generated_per_sample):
    """Each row: tokens = the last prompt the engine saw for it + that reply; mask 1 exactly on replies."""
    for row, replies in zip(rows, generated_per_sample):
        sample = Sample.from_dict(dict(row, rollout_id="q7-r0", reward=1.0))
        validate_sample(sample)
        response = sample.tokens[len(sample.tokens) - sample.response_length:]
        trained = response[sample.loss_mask == 1].tolist()
        assert trained == [t for reply in replies for t in reply]


def test_a_multi_turn_chat_trains_exactly_the_engines_tokens_and_the_environments_suffixes():
    tokenizer = bpe_chat_tokenizer()
    end = tokenizer.eos_token_id
    replies = [encode(tokenizer, "calc(3,4)") + [end], encode(tokenizer, "it is 7.") + [end]]
    engine = ScriptedEngine(replies)
    ctx = context(engine, tokenizer, default_sampling=SamplingConfig(max_tokens=8, stop_token_ids=(end,)))
    chat = ctx.chat([{"role": "user", "content": "what is 3 + 4?"}])

    first = asyncio.run(chat.generate())
    assert first == "calc(3,4)" and chat.messages[-1] == {"role": "assistant", "content": "calc(3,4)"}
    chat.messages.append({"role": "tool", "content": "7"})
    assert asyncio.run(chat.generate()) == "it is 7."

    prompt = encode(tokenizer, chat.render(chat.messages[:1]))
    assert engine.prompts[0] == prompt  # the first request is the rendering of the question
    tool_suffix = engine.prompts[1][len(prompt) + len(replies[0]):]
    assert engine.prompts[1] == prompt + replies[0] + tool_suffix  # earlier output kept as generated
    # The suffix is the template's text between the model's end of turn and the next generation prompt.
    assert tokenizer.decode(tool_suffix) == "\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"

    (row,) = ctx.samples()
    assert row["tokens"].tolist() == engine.prompts[1] + replies[1]
    assert row["response_length"] == len(row["tokens"]) - len(prompt)
    expected_mask = [1] * len(replies[0]) + [0] * len(tool_suffix) + [1] * len(replies[1])
    assert row["loss_mask"].tolist() == expected_mask
    log_probs = row["rollout_log_probs"]
    assert np.allclose(log_probs[np.array(expected_mask) == 1],
                       np.concatenate([-0.1 * np.arange(1, len(r) + 1) for r in replies]))
    assert np.all(log_probs[np.array(expected_mask) == 0] == 0.0)
    assert row["policy_version_min"] == row["policy_version_max"] == 3
    check_rows_are_exact([row], engine, [replies])


def test_a_reply_cut_by_max_tokens_is_kept_as_generated_and_the_template_closes_the_turn():
    tokenizer = bpe_chat_tokenizer()
    replies = [encode(tokenizer, "it is"), encode(tokenizer, "7.")]  # no end-of-turn: finish 'length'
    engine = ScriptedEngine(replies)
    ctx = context(engine, tokenizer)
    chat = ctx.chat([{"role": "user", "content": "what is 3 + 4?"}])
    asyncio.run(chat.generate())
    chat.messages.append({"role": "user", "content": "go on"})
    asyncio.run(chat.generate())
    (row,) = ctx.samples()
    assert row["tokens"].tolist() == engine.prompts[1] + replies[1]
    check_rows_are_exact([row], engine, [replies])


def test_a_template_that_rewrites_history_starts_a_second_sample_under_the_same_rollout():
    tokenizer = bpe_chat_tokenizer(DROPS_EARLIER_REASONING_TEMPLATE)
    end = tokenizer.eos_token_id
    replies = [encode(tokenizer, "<think>3 plus 4</think>calc(3,4)") + [end], encode(tokenizer, "it is 7.") + [end]]
    engine = ScriptedEngine(replies)
    ctx = context(engine, tokenizer, default_sampling=SamplingConfig(max_tokens=32, stop_token_ids=(end,)))
    chat = ctx.chat([{"role": "user", "content": "what is 3 + 4?"}])
    asyncio.run(chat.generate())
    chat.messages.append({"role": "tool", "content": "7"})
    asyncio.run(chat.generate())
    assert chat.restarts == 1
    first, second = ctx.samples()
    assert first["tokens"].tolist() == engine.prompts[0] + replies[0]
    # The second sample starts from the template's own rendering (reasoning dropped), re-tokenized whole.
    assert engine.prompts[1] == encode(tokenizer, chat.render(chat.messages[:-1]))
    assert "<think>" not in tokenizer.decode(engine.prompts[1])
    assert second["tokens"].tolist() == engine.prompts[1] + replies[1]
    assert second["loss_mask"].tolist() == [1] * len(replies[1])
    check_rows_are_exact([first, second], engine, [[replies[0]], [replies[1]]])


def test_a_compacted_history_is_a_new_sample_and_the_digit_tokenizer_renders_append_only():
    tokenizer = build_tokenizer()
    engine = ScriptedEngine([[9], [8], [4]])
    ctx = context(engine, tokenizer)
    chat = ctx.chat([{"role": "user", "content": "3 7"}])
    asyncio.run(chat.generate())
    chat.messages.append({"role": "user", "content": "lower"})
    asyncio.run(chat.generate())
    assert tokenizer.decode(engine.prompts[1]) == "<|user|> 3 7 <|assistant|> 9 <|end|> <|user|> lower <|assistant|>"
    chat.messages[:] = [{"role": "user", "content": "3"}]  # the agent compacts its context
    asyncio.run(chat.generate())
    first, second = ctx.samples()
    assert first["tokens"].tolist() == engine.prompts[1] + [8]
    assert first["loss_mask"].tolist() == [1, 0, 0, 0, 0, 1]
    assert second["tokens"].tolist() == engine.prompts[2] + [4] == encode(tokenizer, "<|user|> 3 <|assistant|>") + [4]


def test_token_sessions_mask_environment_tokens_and_a_prompt_only_segment_is_no_sample():
    engine = ScriptedEngine([[5, 6], [7]])
    ctx = context(engine)
    session = ctx.token_session([1, 2])
    session.append([3])  # before the first generation: still the prompt
    asyncio.run(session.generate())
    session.append([40, 41])
    asyncio.run(session.generate())
    session.restart([9])  # nothing generated after it: no sample
    (row,) = ctx.samples()
    assert row["tokens"].tolist() == [1, 2, 3, 5, 6, 40, 41, 7]
    assert row["response_length"] == 5 and row["loss_mask"].tolist() == [1, 1, 0, 0, 1]
    with pytest.raises(SessionError, match="q7-r0"):
        ctx.chat([{"role": "user", "content": "hi"}])  # no tokenizer in this job


def test_requests_of_one_rollout_and_of_group_members_get_distinct_reproducible_seeds():
    seen = []

    async def engine(token_ids, sampling):
        seen.append(sampling.seed)
        return await ScriptedEngine([[1]])(token_ids, sampling)

    for member in (0, 1):
        ctx = RolloutContext(rollout_id=f"g-r{member}", group_id="g", member=member, group_size=2,
                             engine_generate=engine, seed=100 + member)
        for _ in range(2):
            asyncio.run(ctx.generate([1, 2], SamplingConfig(max_tokens=1, seed=0)))
    assert len(set(seen)) == 4
    again = RolloutContext(rollout_id="g-r0", group_id="g", member=0, group_size=2, engine_generate=engine, seed=100)
    asyncio.run(again.generate([1, 2], SamplingConfig(max_tokens=1, seed=0)))
    assert seen[-1] == seen[0]


def test_a_turn_sampled_across_a_weight_update_records_both_versions():
    """An engine that loaded a version while the turn was in flight: the sample spans both (min 3, max 4), and
    a later turn under one version widens it no further than its own."""
    class UpdatedMidTurn(ScriptedEngine):
        async def __call__(self, token_ids, sampling):
            generation = await super().__call__(token_ids, sampling)
            if len(self.prompts) > 1:
                return generation
            return dataclasses.replace(generation, version_runs=((3, 1), (4, len(generation.response_token_ids) - 1)))

    engine = UpdatedMidTurn([[5, 6, 7], [8]])
    ctx = context(engine)
    session = ctx.token_session([1, 2])
    generation = asyncio.run(session.generate())
    assert generation.token_versions().tolist() == [3, 4, 4]
    session.append([9])
    asyncio.run(session.generate())
    (row,) = ctx.samples()
    assert (row["policy_version_min"], row["policy_version_max"]) == (3, 4)
    # Per token, run-length encoded: 3 for the first token, 4 for the next two, -1 for the appended one, then 3.
    assert row["policy_version_runs"].tolist() == [[3, 1], [4, 2], [-1, 1], [3, 1]]
    validate_sample(Sample.from_dict({**row, "rollout_id": "q7-r0", "reward": 1.0}))
