"""vLLM rollout engines fed by the train group's weight sync (real Ray, real vLLM CPU, real Megatron).

One engine and one train group serve the whole module (vLLM start-up costs seconds); the last
test kills the engine, so it stays last. The engine starts as the job's do: from a directory with
the model's config but no weights, serving once the group's first weights were loaded.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import time
from dataclasses import replace

import numpy as np
import pytest
import ray
import torch

from trainer.hf_checkpoint import write_hf_config
from actors.rollout_engine import EngineConfig, EngineDiedError, EngineError, RolloutEnginePool
from trainer.config import ModelConfig
from actors.weight_sync import publish_weights
from tests.hf_support import response_log_probs
from tests.train_support import ensure_single_process_group, make_samples, sgd_config
from vgbs_ray.agents import RequestTooLongError, SamplingConfig

pytestmark = pytest.mark.slow  # vLLM and Megatron actors: about a minute on 2 cores

MODEL = ModelConfig(seed=7)
PROMPTS = [[5, 17, 3, 99, 42], [1, 2, 3], list(range(30, 70))]


@pytest.fixture(scope="module")
def system(ray_session, tmp_path_factory):
    """A TrainGroup (dp=1) at version 0 and one engine started without weights, then given version 0; also
    the generations of a request sent before that load."""
    from actors.train_group import TrainGroup

    group = TrainGroup(sgd_config(lr=20.0, model=MODEL))
    engines = None
    try:
        model_dir = write_hf_config(tmp_path_factory.mktemp("policy_start"), MODEL)
        engines = RolloutEnginePool(EngineConfig(num_engines=1, max_model_len=MODEL.max_position_embeddings),
                                    str(model_dir))
        early = engines.engines[0].generate.remote(PROMPTS, SamplingConfig(max_tokens=6, seed=2))
        v0 = publish_weights(group, 0)
        engines.wait_for_weights(engines.update_weights(v0))
        yield group, engines, v0, early
    finally:
        if engines is not None:
            engines.shutdown()
        group.shutdown()


def _train_one_step(group):
    from vgbs_ray.config import BatchConfig, ParallelConfig
    from vgbs_ray.layout.schedule import build_dp_schedule
    from vgbs_ray.layout.shard import build_step_shards

    samples = make_samples(3, 4)
    schedule = build_dp_schedule([s.total_length for s in samples], [s.rollout_id for s in samples],
                                 ParallelConfig(dp_size=1), BatchConfig(global_batch_size=4, max_tokens_per_gpu=4096))
    group.train_shards(build_step_shards(samples, schedule.steps[0], 0))


def _megatron_log_probs(hf_weights: dict, generations) -> list[np.ndarray]:
    """The trainer's view: a Megatron model with the published weights scores every generation."""
    from trainer.hf_checkpoint import load_hf_weights
    from trainer.model import build_gpt_model

    ensure_single_process_group()
    model = build_gpt_model(MODEL).eval()
    load_hf_weights(model, {k: torch.from_numpy(np.array(v)) for k, v in hf_weights.items()}, MODEL)
    return response_log_probs(model, generations)


def test_an_engine_started_without_weights_answers_its_first_request_with_the_first_load(system):
    """Placeholder weights never sample: the request sent before version 0 arrived was answered by it."""
    _, engines, v0, early = system
    generations = ray.get(early, timeout=60)
    assert [g.policy_version for g in generations] == [0, 0, 0]
    for got, expected in zip([g.response_log_probs for g in generations],
                             _megatron_log_probs(ray.get(v0.ref), generations)):
        assert np.abs(got - expected).max() < 1e-4, np.abs(got - expected).max()


def test_after_a_sync_engine_log_probs_equal_the_trainers(system):
    group, engines, _, _ = system
    _train_one_step(group)
    v1 = publish_weights(group, 1)
    assert v1.num_bytes == sum(a.nbytes for a in ray.get(v1.ref).values())
    loads = engines.update_weights(v1)  # returns at once: the trainer does not wait for the engines
    [load] = engines.wait_for_weights(loads)
    assert (load.policy_version, load.num_bytes, load.engine) == (1, v1.num_bytes, engines.names[0])
    generations = engines.generate(PROMPTS, SamplingConfig(max_tokens=12, seed=1))
    assert [g.policy_version for g in generations] == [1, 1, 1]
    assert all(len(g.response_token_ids) == 12 and g.finish_reason == "length" for g in generations)
    for got, expected in zip([g.response_log_probs for g in generations],
                             _megatron_log_probs(ray.get(v1.ref), generations)):
        assert np.abs(got - expected).max() < 1e-4, np.abs(got - expected).max()


def test_sync_to_other_weights_and_back_restores_the_outputs(system):
    group, engines, v0, _ = system
    sampling = SamplingConfig(max_tokens=16, seed=11)
    current = publish_weights(group, 2)  # whatever the group holds now
    engines.wait_for_weights(engines.update_weights(current))
    before = engines.generate(PROMPTS, sampling)
    engines.wait_for_weights(engines.update_weights(v0))  # the initial weights: a different policy
    other = engines.generate(PROMPTS, sampling)
    assert [g.policy_version for g in other] == [0, 0, 0]
    assert any(not np.array_equal(a.response_token_ids, b.response_token_ids) for a, b in zip(before, other))
    assert not np.allclose(before[0].response_log_probs[:1], other[0].response_log_probs[:1], atol=1e-3)
    engines.wait_for_weights(engines.update_weights(current))
    after = engines.generate(PROMPTS, sampling)
    for a, b in zip(before, after):
        assert np.array_equal(a.response_token_ids, b.response_token_ids)
        assert np.array_equal(a.response_log_probs, b.response_log_probs)
        assert b.policy_version == 2


def test_a_request_longer_than_the_engine_allows_is_refused(system):
    _, engines, _, _ = system
    limit = engines.config.max_model_len
    with pytest.raises(RequestTooLongError, match=rf"{engines.names[0]}: request 1 has a {limit - 4}-token prompt "
                                                  rf"\+ max_tokens=8 > max_model_len={limit}"):
        engines.generate([[1, 2], [3] * (limit - 4)], SamplingConfig(max_tokens=8))


def test_a_call_without_prompts_is_answered_at_once(system):
    _, engines, _, _ = system
    assert engines.generate([], SamplingConfig(max_tokens=4)) == []


def test_a_stop_token_ends_the_response_and_keeps_its_log_prob(system):
    _, engines, _, _ = system
    [greedy] = engines.generate(PROMPTS[:1], SamplingConfig(max_tokens=8, temperature=0.0))
    stop = int(greedy.response_token_ids[2])
    first = list(greedy.response_token_ids).index(stop)
    [stopped] = engines.generate(PROMPTS[:1], SamplingConfig(max_tokens=8, temperature=0.0, stop_token_ids=(stop,)))
    assert stopped.finish_reason == "stop"
    assert stopped.response_token_ids.tolist() == greedy.response_token_ids[:first + 1].tolist()
    assert np.array_equal(stopped.response_log_probs, greedy.response_log_probs[:first + 1])


def test_concurrent_async_callers_through_a_pickled_client_match_one_blocking_call(system):
    """What producers use: `EngineClient` travels to other actors; concurrent calls are batched by the engine."""
    _, engines, _, _ = system
    client = pickle.loads(ray.cloudpickle.dumps(engines.client()))
    sampling = SamplingConfig(max_tokens=8, seed=5)

    async def two_callers():
        return await asyncio.gather(*(client.generate([prompt], sampling) for prompt in PROMPTS[:2]))

    together = [g for call in asyncio.run(two_callers()) for g in call]
    alone = [engines.generate([prompt], sampling)[0] for prompt in PROMPTS[:2]]
    for a, b in zip(together, alone):
        assert np.array_equal(a.response_token_ids, b.response_token_ids)
        assert np.allclose(a.response_log_probs, b.response_log_probs, atol=1e-5)


def _long_request(engines, seed: int):
    """A request of max_model_len - 4 tokens, and a coroutine that returns once the engine holds it."""
    engine = engines.engines[0]
    before = ray.get(engine.utilization.remote()).requests
    long = engine.generate.remote([[1, 2, 3, 4]], SamplingConfig(max_tokens=engines.config.max_model_len - 4, seed=seed))

    async def in_flight():
        deadline = time.monotonic() + 60
        while (await engine.utilization.remote()).requests == before:
            assert time.monotonic() < deadline, "the long request never reached the engine"
            await asyncio.sleep(0.01)

    return long, in_flight


def test_after_a_load_a_prompt_seen_before_does_not_reuse_the_old_weights_cache(system):
    """A long prompt (whole cache blocks) sampled under one version, then the same prompt after a load: its log-probs
    are the new weights', not those of keys and values cached under the old ones (reset on every load)."""
    group, engines, v0, _ = system
    prompt = [[(7 * i) % 120 + 1 for i in range(engines.config.max_model_len - 8)]]
    current = publish_weights(group, 5)
    engines.wait_for_weights(engines.update_weights(current))
    engines.generate(prompt, SamplingConfig(max_tokens=4, seed=2))  # fills the prefix cache under version 5
    (before,) = engines.utilization()
    engines.generate(prompt, SamplingConfig(max_tokens=4, seed=3))  # the same version: its blocks are reused
    (after,) = engines.utilization()
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 128  # at least one whole block (128 tokens on CPU)
    assert after.prefix_cache_hit_rate is not None
    engines.wait_for_weights(engines.update_weights(replace(v0, policy_version=6)))
    [again] = engines.generate(prompt, SamplingConfig(max_tokens=4, seed=2))
    [expected] = _megatron_log_probs(ray.get(v0.ref), [again])
    assert again.policy_version == 6
    assert np.abs(again.response_log_probs - expected).max() < 1e-4, np.abs(again.response_log_probs - expected).max()


def test_a_short_request_finishes_while_a_long_one_runs(system):
    """Continuous batching: a request that arrives while a long one decodes joins the running batch and leaves
    it when it is done; it does not wait for the long one (the old batch-at-a-time engine made it)."""
    _, engines, _, _ = system
    long, in_flight = _long_request(engines, seed=4)

    async def short_during_long():
        await in_flight()
        before = await engines.engines[0].utilization.remote()
        short = await engines.engines[0].generate.remote([[9, 8, 7]], SamplingConfig(max_tokens=4, seed=1))
        return short, before, (await engines.engines[0].utilization.remote())

    ([short], before, after) = asyncio.run(short_during_long())
    assert len(short.response_token_ids) == 4
    assert not ray.wait([long], timeout=0)[0], "the short request waited for the long one"
    shared_steps = (after.request_steps - before.request_steps) - (after.engine_steps - before.engine_steps)
    assert shared_steps >= 4  # every step of the short request decoded the long one too
    [long_generation] = ray.get(long)
    assert len(long_generation.response_token_ids) == engines.config.max_model_len - 4


def test_a_client_call_streams_each_generation_as_it_finishes(system):
    """One call of a short and a long request through the pickled client: the short one's generation arrives while
    the long one still runs, and both equal what a blocking call of the same requests gives."""
    _, engines, _, _ = system
    client = pickle.loads(ray.cloudpickle.dumps(engines.client()))
    long_tokens = engines.config.max_model_len - 4
    samplings = [SamplingConfig(max_tokens=long_tokens, seed=8), SamplingConfig(max_tokens=3, seed=9)]
    prompts = [[1, 2, 3, 4], [9, 8, 7]]

    async def stream():
        return [(index, generation) async for index, generation in client.generate_each(prompts, samplings)]

    arrivals = asyncio.run(stream())
    assert [index for index, _ in arrivals] == [1, 0]  # the short one first
    blocking = engines.generate(prompts, samplings)
    for index, generation in arrivals:
        assert np.array_equal(generation.response_token_ids, blocking[index].response_token_ids)
        assert np.allclose(generation.response_log_probs, blocking[index].response_log_probs, atol=1e-5)
    assert len(arrivals[0][1].response_token_ids) == 3 and len(arrivals[1][1].response_token_ids) == long_tokens


def test_a_weight_update_lands_while_a_request_is_in_flight(system):
    """The update is neither aborted nor waited for: the long request's first tokens carry the old version, the
    rest the new one, and each token's behaviour log-prob is what the trainer computes for it under the weights
    that sampled it (after the update vLLM recomputed the request's keys and values under the new weights)."""
    group, engines, v0, _ = system
    current = publish_weights(group, 3)
    engines.wait_for_weights(engines.update_weights(current))
    long, in_flight = _long_request(engines, seed=6)

    async def update_during_long():
        await in_flight()
        return await engines.engines[0].update_weights.remote(4, v0.ref)  # version 4 = the initial weights

    load = asyncio.run(update_during_long())
    assert load.requests_in_flight == 1 and load.policy_version == 4
    [mixed] = ray.get(long)
    assert ray.get(engines.engines[0].utilization.remote()).in_flight_loads >= 1
    (old_version, old_tokens), (new_version, new_tokens) = mixed.version_runs
    assert (old_version, new_version, mixed.policy_version) == (3, 4, 3) and old_tokens > 0 and new_tokens > 0
    versions = mixed.token_versions()
    assert versions.tolist() == [3] * old_tokens + [4] * new_tokens
    [under_old] = _megatron_log_probs(ray.get(current.ref), [mixed])
    [under_new] = _megatron_log_probs(ray.get(v0.ref), [mixed])
    expected = np.where(versions == 3, under_old, under_new)
    assert np.abs(mixed.response_log_probs - expected).max() < 1e-4, np.abs(mixed.response_log_probs - expected).max()


def test_utilization_counts_requests_and_splits_the_engines_time_into_busy_and_idle(system):
    """What the job reports as engine idle time: the engine thread's wait for work vs its work."""
    _, engines, _, _ = system
    (before,) = engines.utilization()
    engines.generate(PROMPTS[:2], SamplingConfig(max_tokens=4, seed=1))
    (after,) = engines.utilization()
    assert after.requests == before.requests + 2
    assert after.engine_steps >= before.engine_steps + 4  # 4 tokens each: at least 4 steps, both requests in each
    assert after.request_steps - before.request_steps == 2 * (after.engine_steps - before.engine_steps)
    assert after.busy_s > before.busy_s
    assert after.idle_s >= before.idle_s > 0  # the engine waited for this module's first call
    assert 0 < after.idle_share < 1
    # The KV cache vLLM allocated, in tokens: about kv_cache_gib over the bytes one token's keys and values take
    # (float32, every layer, every key/value head), never more; what admission_token_budget=engines uses.
    token_bytes = 2 * MODEL.num_layers * MODEL.num_query_groups * MODEL.head_dim * 4
    ceiling = engines.config.kv_cache_gib * (1 << 30) / token_bytes
    assert 0.5 * ceiling <= after.kv_cache_tokens <= ceiling and engines.kv_cache_tokens() == after.kv_cache_tokens


def test_an_adapter_sent_to_an_engine_without_lora_is_refused_naming_it(system):
    """The module's engine serves no LoRA adapter: a version carrying one is refused before anything loads, and
    the engine keeps serving the version it held."""
    from vgbs_ray.models.lora import sync_key

    _, engines, v0, _ = system
    engine = engines.engines[0]
    held = ray.get(engine.current_policy_version.remote(), timeout=30)
    adapter_key = sync_key("decoder.layers.0.self_attention.linear_qkv.lora.policy.q_proj_A")
    weights = dict(ray.get(v0.ref), **{adapter_key: np.zeros((4, MODEL.hidden_size), dtype=np.float32)})
    with pytest.raises(EngineError, match=r"carries LoRA adapter\(s\) \['policy'\], but the engine serves none"):
        ray.get(engine.update_weights.remote(6, weights), timeout=120)
    assert {g.policy_version for g in engines.generate(PROMPTS, SamplingConfig(max_tokens=2))} == {held}


def test_a_dead_engine_is_an_error_naming_it_and_its_replacement_serves_the_newest_weights_first(system):
    """Runs last: it kills the module's engine. A blocking call fails at once naming it; a client's request
    waits for a replacement (or fails naming every engine when none comes in time). The replacement
    starts from the start directory (no weights) on the same bundle, but the waiting request is answered only after it
    loaded the published version: its log-probs are the trainer's for that version."""
    group, engines, _, _ = system
    ray.kill(engines.engines[0], no_restart=True)
    start = time.monotonic()
    with pytest.raises(EngineDiedError, match=rf"rollout engine {engines.names[0]} died"):
        engines.generate(PROMPTS, SamplingConfig(max_tokens=4))
    with pytest.raises(EngineDiedError, match=rf"every rollout engine died \({engines.names[0]}\)"):
        asyncio.run(engines.client(replacement_timeout_s=1.0).generate(PROMPTS, SamplingConfig(max_tokens=4)))
    assert time.monotonic() - start < 30

    _train_one_step(group)
    newest = publish_weights(group, 7)
    client = engines.client()
    replacement = engines.replace(0, serve_from_version=7)  # no weights yet: the next sync brings them

    async def request_then_load():
        waiting = asyncio.ensure_future(client.generate(PROMPTS, SamplingConfig(max_tokens=12, seed=3)))
        deadline = time.monotonic() + 60
        while not (await replacement.utilization.remote()).requests_waiting_for_version:
            assert time.monotonic() < deadline and not waiting.done(), "the request never reached the replacement"
            await asyncio.sleep(0.05)
        await replacement.update_weights.remote(newest.policy_version, newest.ref)
        return await asyncio.wait_for(waiting, timeout=120)

    generations = asyncio.run(request_then_load())
    assert [g.policy_version for g in generations] == [7, 7, 7]
    for got, expected in zip([g.response_log_probs for g in generations],
                             _megatron_log_probs(ray.get(newest.ref), generations)):
        assert np.abs(got - expected).max() < 1e-4, np.abs(got - expected).max()


def test_a_load_that_fails_half_way_breaks_the_engine_until_it_is_replaced(system):
    """Runs after the dead-engine test (its replacement serves version 7). A load whose second tensor does not
    fit fails after the first was copied: the engine's weights mix two versions, so it refuses every request
    (a client treats it as gone), reports itself hung to the engine watch, and loads nothing more; a
    replacement serves again."""
    from actors.rollout_engine import EngineBrokenError

    group, engines, _, _ = system
    newest = publish_weights(group, 8)
    weights = ray.get(newest.ref)
    first, second = list(weights)[:2]
    half = {first: weights[first], second: np.zeros((3, 3), dtype=np.float32)}  # the second cannot be copied
    engine = engines.engines[0]
    with pytest.raises(EngineBrokenError, match="loading version 8 failed half-way"):
        ray.get(engine.update_weights.remote(8, half), timeout=120)
    assert ray.get(engine.health.remote(), timeout=30) == float("inf")  # the engine watch replaces a hung engine
    with pytest.raises(EngineBrokenError, match="serves no more requests"):
        engines.generate(PROMPTS, SamplingConfig(max_tokens=4))
    with pytest.raises(EngineDiedError, match="every rollout engine died"):  # the client sends elsewhere: none left
        asyncio.run(engines.client(replacement_timeout_s=1.0).generate(PROMPTS, SamplingConfig(max_tokens=4)))
    with pytest.raises(EngineBrokenError, match="loads no more versions"):
        ray.get(engine.update_weights.remote(8, weights), timeout=120)
    engines.replace(0, serve_from_version=8, weights=(newest,))
    assert {g.policy_version for g in engines.generate(PROMPTS, SamplingConfig(max_tokens=4))} == {8}


def test_a_rollout_over_three_versions_whose_engine_dies_mid_turn_keeps_one_sample_of_them(system):
    """Runs last. One rollout's token session over three versions: turn 1 at version 20; a load; turn 2 at 21;
    then turn 3 goes to a replacement engine still waiting for version 22, which dies during its update to 22,
    with the request in it (events, not sleeps: the request shows in its `requests_waiting_for_version`; the
    engine's process is frozen with SIGSTOP before the update is sent, so the update cannot finish before the
    SIGKILL). The update's call fails with the engine's death; the client sends the request again, under the
    same rollout, to the next replacement, which answers at 22. The rollout is one sample: the turns' context and
    answers, each answer's tokens labelled with the version that sampled it, valid under the contract; nothing of
    the lost request is in it."""
    from vgbs_ray.agents import RolloutContext
    from vgbs_ray.sample import Sample, validate_rollout

    group, engines, _, _ = system
    client = engines.client()

    async def engine_generate(token_ids, sampling):
        (generation,) = await client.generate([list(token_ids)], sampling)
        return generation

    def next_version(version: int):
        _train_one_step(group)
        return publish_weights(group, version)

    engines.wait_for_weights(engines.update_weights(next_version(20)))
    ctx = RolloutContext(rollout_id="p3-r1", group_id="p3", member=1, group_size=2, engine_generate=engine_generate,
                         default_sampling=SamplingConfig(max_tokens=4, seed=5))
    session = ctx.token_session(PROMPTS[0])
    answers = [asyncio.run(session.generate())]
    engines.wait_for_weights(engines.update_weights(next_version(21)))
    session.append([7, 8])  # the environment's reply: context
    answers.append(asyncio.run(session.generate()))
    session.append([9])

    newest = next_version(22)
    doomed = engines.replace(0, serve_from_version=22)  # no weights yet: a request waits inside it

    async def third_turn_through_a_death():
        turn = asyncio.ensure_future(session.generate())
        deadline = time.monotonic() + 60
        while not (await doomed.utilization.remote()).requests_waiting_for_version:
            assert time.monotonic() < deadline and not turn.done(), "the request never reached the engine"
            await asyncio.sleep(0.05)
        pid = await doomed.__ray_call__.remote(lambda engine: os.getpid())
        os.kill(pid, signal.SIGSTOP)
        (update,) = engines.update_weights(newest)  # sent to the frozen engine: it dies with the update in flight
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ray.exceptions.RayActorError):
            await asyncio.wait_for(update, timeout=60)
        assert not turn.done()
        await asyncio.to_thread(engines.replace, 0, serve_from_version=22, weights=(newest,))
        return await asyncio.wait_for(turn, timeout=120)

    answers.append(asyncio.run(third_turn_through_a_death()))
    assert [a.policy_version for a in answers] == [20, 21, 22]
    (row,) = ctx.samples()
    sample = Sample.from_dict(dict(row, rollout_id=ctx.rollout_id, reward=1.0))  # as the producer pushes it
    validate_rollout([sample])
    responses = [a.response_token_ids.tolist() for a in answers]
    assert sample.tokens.tolist() == PROMPTS[0] + responses[0] + [7, 8] + responses[1] + [9] + responses[2]
    assert sample.policy_version_runs.tolist() == [[20, len(responses[0])], [-1, 2], [21, len(responses[1])],
                                                   [-1, 1], [22, len(responses[2])]]
