"""run_group: a group is trained whole or lost whole with a named reason; loading agents by import path;
prompt sources as pure functions of a position (no Ray: the producer actor runs exactly this)."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest

from tests.agent_support import ScriptedEngine
from vgbs_ray.agents import AgentResult, RequestTooLongError, RolloutContext, SamplingConfig, load_agent, run_group
from vgbs_ray.errors import ConfigError
from vgbs_ray.prompt_source import DatasetPrompts, GeneratedPrompts, producer_positions


def contexts(group_size=3, replies=((4, 5),) * 3, engine=None):
    engine = engine or ScriptedEngine(list(replies))
    return [RolloutContext(rollout_id=f"p0-r{m}", group_id="p0", member=m, group_size=group_size,
                           engine_generate=engine) for m in range(group_size)]


async def good(row, ctx):
    session = ctx.token_session(row["prompt"])
    await session.generate()
    return AgentResult(reward=float(ctx.member), metrics={"turns": 1})


def test_a_finished_group_yields_every_members_samples_with_one_reward_each():
    outcome = asyncio.run(run_group(good, {"prompt": [1, 2]}, contexts(), timeout_s=60))
    assert outcome.failure is None
    assert [s["rollout_id"] for s in outcome.samples] == ["p0-r0", "p0-r1", "p0-r2"]
    assert [s["reward"] for s in outcome.samples] == [0.0, 1.0, 2.0]
    assert all(s["group_id"] == "p0" and s["group_size"] == 3 and s["rollout_size"] == 1 for s in outcome.samples)
    assert outcome.metrics == {"num_samples": 3.0, "turns": 3.0}


async def raises(row, ctx):
    if ctx.member == 1:
        raise KeyError("the tool is down")
    return await good(row, ctx)


async def hangs(row, ctx):
    if ctx.member == 2:
        await asyncio.Event().wait()  # never set: only the timeout ends it
    return await good(row, ctx)


async def nan_reward(row, ctx):
    await good(row, ctx)
    return math.nan if ctx.member == 0 else 1.0


async def too_long_request(row, ctx):
    raise RequestTooLongError("engine-0: request 0 has a 40-token prompt + max_tokens=8 > max_model_len=32")


async def generates_nothing(row, ctx):
    return 1.0


@pytest.mark.parametrize("agent, reason, member", [
    (raises, "agent_error", 1), (hangs, "agent_timeout", 2), (nan_reward, "non_finite_reward", 0),
    (too_long_request, "too_long", 0), (generates_nothing, "no_samples", 0),
])
def test_each_failure_kind_loses_the_whole_group_with_its_reason(agent, reason, member):
    outcome = asyncio.run(run_group(agent, {"prompt": [1, 2]}, contexts(), timeout_s=0.5))
    assert outcome.samples == []
    got_reason, got_member, detail = outcome.failure
    assert (got_reason, got_member) == (reason, member)
    assert f"p0-r{member}" in detail


def test_a_sample_longer_than_the_model_takes_is_too_long():
    outcome = asyncio.run(run_group(good, {"prompt": [1] * 10}, contexts(), timeout_s=60, max_sequence_length=11))
    assert outcome.failure[0] == "too_long" and "12-token sample" in outcome.failure[2]


def test_a_fatal_error_is_not_the_agents_fault_and_propagates():
    class EngineGone(RuntimeError):
        pass

    async def engine_died(row, ctx):
        raise EngineGone("rollout engine 0 died")

    with pytest.raises(EngineGone):
        asyncio.run(run_group(engine_died, {}, contexts(), timeout_s=60, fatal_errors=(EngineGone,)))


def test_agents_load_by_import_path_with_clear_errors():
    agent = load_agent("examples.digit_agent:make_agent", {"turn_rewards": [1.0]})
    assert asyncio.iscoroutinefunction(agent)
    with pytest.raises(ConfigError, match="module:function|'module.path:name'"):
        load_agent("examples.digit_agent.make_agent")
    with pytest.raises(ConfigError, match="cannot import 'no_such_pkg.agents'"):
        load_agent("no_such_pkg.agents:make")
    with pytest.raises(ConfigError, match="has no 'nope'"):
        load_agent("examples.digit_agent:nope")
    with pytest.raises(ConfigError, match="must return an async function"):
        load_agent("examples.digit_agent:build_tokenizer")


def test_a_dataset_source_visits_every_row_once_per_epoch_in_a_seeded_order():
    rows = [{"q": i, "extra": -i} for i in range(7)]
    source = DatasetPrompts(rows, epochs=2, shuffle_seed=3, keys=("q",))
    prompts = [source.prompt(p) for p in range(len(source))]
    assert len(source) == 14
    for epoch in (0, 1):
        assert sorted(row["q"] for _, row in prompts[7 * epoch:7 * epoch + 7]) == list(range(7))
        assert all(key.startswith(f"e{epoch}-row") for key, _ in prompts[7 * epoch:7 * epoch + 7])
    assert [r["q"] for _, r in prompts[:7]] != [r["q"] for _, r in prompts[7:]]  # reshuffled per epoch
    assert all(set(row) == {"q"} for _, row in prompts)
    again = DatasetPrompts(rows, epochs=2, shuffle_seed=3, keys=("q",))
    assert [again.prompt(p) for p in range(14)] == prompts  # a pure function of the position
    with pytest.raises(ConfigError, match=r"no column\(s\) \['answer'\]"):
        DatasetPrompts(rows, keys=("answer",))
    assert DatasetPrompts(rows, shuffle_seed=None).prompt(3) == ("e0-row3", rows[3])


def test_producers_split_the_positions_and_a_cursor_resumes_exactly_there():
    split = [list(producer_positions(i, 3, length=10)) for i in range(3)]
    assert sorted(p for positions in split for p in positions) == list(range(10))
    assert list(producer_positions(1, 3, start=2, length=10)) == split[1][2:]
    endless = GeneratedPrompts(lambda p: {"n": p * p})
    assert endless.prompt(4) == ("p4", {"n": 16})


def test_one_too_long_request_in_a_batched_engine_call_fails_only_its_own_caller():
    from actors.agent_producer import _Batcher

    class Engines:
        """Refuses a whole call when one prompt is longer than 3 tokens, as the engine does."""
        def __init__(self):
            self.calls = []

        names = ["scripted"]

        async def generate_each(self, prompts, samplings, prefer=None):
            self.calls.append(len(prompts))
            if any(len(p) > 3 for p in prompts):
                raise RequestTooLongError("request longer than max_model_len")
            for index, (prompt, sampling) in enumerate(zip(prompts, samplings)):
                yield index, await ScriptedEngine([[9]])(prompt, sampling)

    engines = Engines()
    batcher = _Batcher(engines, {"engine_wait_s": 0.0})

    async def three_callers():
        return await asyncio.gather(*[batcher.generate(f"g-r{i}", p, SamplingConfig())
                                      for i, p in enumerate(([1], [1, 2, 3, 4, 5], [2]))],
                                    return_exceptions=True)

    short, long, other = asyncio.run(three_callers())
    assert engines.calls[0] == 3  # one batched call first
    assert isinstance(long, RequestTooLongError)
    assert short.response_token_ids.tolist() == other.response_token_ids.tolist() == [9]


def test_each_caller_of_a_batched_engine_call_is_answered_as_its_own_request_finishes():
    """The engine streams a call's generations as they finish: the caller whose request finished first gets it
    while the other's request still runs (the call is not held until its longest request ends)."""
    from actors.agent_producer import _Batcher

    class Engines:
        names = ["scripted"]

        def __init__(self):
            self.long_may_finish = asyncio.Event()

        async def generate_each(self, prompts, samplings, prefer=None):
            short, long = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
            yield short, await ScriptedEngine([[7]])(prompts[short], samplings[short])  # finishes first
            await self.long_may_finish.wait()
            yield long, await ScriptedEngine([[8, 8, 8]])(prompts[long], samplings[long])

    engines = Engines()
    batcher = _Batcher(engines, {"engine_wait_s": 0.0})

    async def two_callers():
        long = asyncio.ensure_future(batcher.generate("g-r0", [1, 2], SamplingConfig()))
        short = await batcher.generate("g-r1", [3], SamplingConfig())
        assert not long.done()  # answered while the long request still runs
        engines.long_may_finish.set()
        return short, await long

    short, long = asyncio.run(two_callers())
    assert short.response_token_ids.tolist() == [7] and long.response_token_ids.tolist() == [8, 8, 8]


def test_a_rollouts_next_request_goes_to_the_engine_that_served_its_previous_one():
    """Session-sticky routing in the producer: one call per preferred engine; a rollout without a previous request
    (or whose group ended: `forget`) is left to the client's least-loaded choice."""
    from actors.agent_producer import _Batcher

    class Engines:
        names = ["e0", "e1", "e2"]

        def __init__(self):
            self.calls = []

        async def generate_each(self, prompts, samplings, prefer=None):
            self.calls.append((prefer, len(prompts)))
            engine = self.names[prefer if prefer is not None else len(self.calls) % 3]  # "least loaded"
            for index, (prompt, sampling) in enumerate(zip(prompts, samplings)):
                generation = await ScriptedEngine([[7]])(prompt, sampling)
                yield index, dataclasses.replace(generation, engine=engine)

    engines = Engines()
    batcher = _Batcher(engines, {"engine_wait_s": 0.0})

    async def turns(rollout_ids):
        return await asyncio.gather(*[batcher.generate(r, [1], SamplingConfig()) for r in rollout_ids])

    first = asyncio.run(turns(["a", "b"]))  # one call, no preference: served by e1
    assert engines.calls == [(None, 2)] and {g.engine for g in first} == {"e1"}
    asyncio.run(turns(["c"]))  # a new rollout alone: e2
    engines.calls.clear()
    again = asyncio.run(turns(["a", "b", "c", "d"]))
    assert sorted(engines.calls, key=str) == sorted([(1, 2), (2, 1), (None, 1)], key=str)
    assert [g.engine for g in again[:3]] == ["e1", "e1", "e2"]
    batcher.forget(["a"])
    engines.calls.clear()
    asyncio.run(turns(["a"]))
    assert engines.calls == [(None, 1)]
