"""The tool-use task (examples/lookup_agent.py) through the live endpoint, with a scripted engine.

The engine says known token ids of the task's word-level vocabulary; the endpoint decodes them and vLLM's
`hermes` parser reads the call word as a `lookup` call, so the example's own `run` gets `tool_calls`, sends the
tool's result and is rewarded as the task says. The trained sample is the first rendering, the engine's call
token, the tool result's rendering, the engine's answer: mask 1 exactly on the engine's tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import json

import numpy as np
import pytest

from examples import lookup_agent
from jobs.job_config import LOOKUP_VOCAB_SIZE, load_job_config
from tests.test_agent_endpoint import endpoint, trained_runs  # noqa: F401 - the live endpoint fixture
from vgbs_ray.agents import Generation, RolloutContext, SamplingConfig
from vgbs_ray.agents.openai_agent import make_agent
from vgbs_ray.checkpoint_files import load_tokenizer

TOKENIZER = load_tokenizer("examples/lookup_tokenizer")
ROLLOUTS = itertools.count()
WORD = {word: index for index, word in enumerate(lookup_agent.VOCABULARY)}


class WordEngine:
    """Answers request k with the word `replies[k]` (one token, as the task's max_tokens=1 asks)."""

    def __init__(self, replies: list[str]):
        self.replies, self.prompts, self.outputs = replies, [], []

    async def __call__(self, token_ids, sampling: SamplingConfig) -> Generation:
        ids = [WORD[self.replies[len(self.prompts)]]][:sampling.max_tokens]
        self.prompts.append(list(token_ids))
        self.outputs.append(ids)
        return Generation(prompt_token_ids=np.asarray(token_ids, dtype=np.int64),
                          response_token_ids=np.asarray(ids, dtype=np.int64),
                          response_log_probs=np.full(len(ids), -1.0, dtype=np.float32),
                          policy_version=4, finish_reason="length", engine="words")


def run_rollout(endpoint, replies: list[str], secret: int, tmp_path, rollout_id: str):
    engine = WordEngine(replies)
    ctx = RolloutContext(rollout_id=rollout_id, group_id=rollout_id.split("-")[0], member=0, group_size=2,
                         engine_generate=engine, tokenizer=TOKENIZER,
                         default_sampling=SamplingConfig(max_tokens=4, stop_token_ids=(TOKENIZER.eos_token_id,)))
    endpoint.open(ctx)
    record = tmp_path / f"{rollout_id}.jsonl"
    agent = make_agent("examples.lookup_agent:run", {"record_path": str(record)})
    result = asyncio.run_coroutine_threadsafe(agent({"secret": secret}, ctx), endpoint.loop).result(timeout=60)
    endpoint.close(ctx.endpoint)
    return result, engine, ctx.samples(), json.loads(record.read_text())


def test_the_committed_tokenizer_is_the_tasks_and_fits_the_presets_model():
    built = lookup_agent.build_tokenizer()
    assert TOKENIZER.get_vocab() == built.get_vocab() and TOKENIZER.chat_template == built.chat_template
    assert LOOKUP_VOCAB_SIZE == len(lookup_agent.VOCABULARY)
    config = load_job_config(preset="tool_use")
    assert config.train.model.vocab_size == LOOKUP_VOCAB_SIZE
    assert config.rollout.endpoint.enabled and config.rollout.endpoint.tool_parser == "hermes"


def test_a_parsed_lookup_then_the_secret_earns_one_and_trains_the_engines_tokens(endpoint, tmp_path):
    result, engine, samples, record = run_rollout(endpoint, [lookup_agent.CALL, "7"], 7, tmp_path, "l1-r0")
    assert result.reward == 1.0 and result.metrics == {"called": 1.0}
    assert record == {"version": "policy-v4", "called": True, "reward": 1.0}
    (row,) = samples  # the answer's request extended the call's: one sample
    first_prompt = engine.prompts[0]
    tool_result = engine.prompts[1][len(first_prompt) + 1:]
    # the call's end of turn, the tool's reply and the next generation prompt: context, never the call re-rendered
    assert TOKENIZER.decode(tool_result).split() == ["<|end|>", "<|tool|>", "7", "<|assistant|>"]
    assert row["tokens"].tolist() == first_prompt + engine.outputs[0] + tool_result + engine.outputs[1]
    assert trained_runs(row) == engine.outputs == [[WORD[lookup_agent.CALL]], [WORD["7"]]]


@pytest.mark.parametrize("replies, secret, reward, called", [
    (["3"], 3, 1.0, False),                                   # a lucky guess
    (["3"], 4, 0.0, False),                                   # a wrong guess
    (["higher"], 4, 0.0, False),                              # not an answer
    ([lookup_agent.CALL, "2", "4"], 4, 0.5, True),            # right on the second answer, after "higher"
    ([lookup_agent.CALL, "2", "5"], 4, lookup_agent.CALLED_CREDIT, True),  # looked up, never right
    ([lookup_agent.CALL, lookup_agent.CALL], 4, 0.0, True),   # a second call instead of an answer
])
def test_the_reward_follows_the_tasks_rules(endpoint, tmp_path, replies, secret, reward, called):
    result, engine, _, record = run_rollout(endpoint, replies, secret, tmp_path, f"r{next(ROLLOUTS)}-r0")
    assert (result.reward, result.metrics["called"], record["called"]) == (reward, float(called), called)
    assert len(engine.prompts) == len(replies)
