"""The rollout engine serves the policy's LoRA adapter (vLLM's LoRA support): a load carries the adapter alone once
the engine holds the base, and the engine's log-probs equal the trainer's with the newest adapter.

Real vLLM CPU engine in a Ray actor; the trainer is an in-process Megatron rank with the same base and adapters.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import ray

from trainer.hf_checkpoint import write_hf_config
from actors.rollout_engine import (EngineConfig, EngineError, RolloutEnginePool, engine_files_dirs,
                                   pool_files_dirs)
from trainer.config import ModelConfig
from actors.weight_sync import hf_tensors_from_full
from tests.hf_support import response_log_probs
from tests.test_lora import LORA, random_adapters
from tests.train_support import inprocess_trainer, sgd_config
from vgbs_ray.agents import SamplingConfig

pytestmark = pytest.mark.slow  # a vLLM engine: tens of seconds on 2 cores

MODEL = ModelConfig(seed=5)
PROMPTS = [[3, 14, 15, 92, 65], list(range(40, 61)), [7] * 9]


def _weights(base: dict, adapters: dict) -> dict[str, np.ndarray]:
    return {name: t.numpy() for name, t in hf_tensors_from_full(base, MODEL, adapters=adapters).items()}


def _tenant_adapters():
    from tests.test_lora import _tenants_config

    config = dataclasses.replace(_tenants_config(), model=MODEL)
    return config, tuple((name, adapter.lora) for name, adapter in config.adapters.items())


@pytest.fixture(scope="module")
def lora_engines(ray_session, tmp_path_factory):
    """{"policy": an engine serving one adapter, "tenants": one serving the tenants' two}: both start at once (a
    start is one core's work for ~7 s); each test waits for its own."""
    model_dir = str(write_hf_config(tmp_path_factory.mktemp("lora-engine"), MODEL))
    configs = {"policy": ((("policy", LORA),), 1), "tenants": (_tenant_adapters()[1], 0)}  # adapters, version
    pools = {}
    try:
        for name, (adapters, version) in configs.items():
            engine_config = EngineConfig(num_engines=1, max_model_len=MODEL.max_position_embeddings,
                                         lora_adapters=adapters)
            pools[name] = RolloutEnginePool(engine_config, model_dir, policy_version=version,
                                            name_prefix=f"lora-{name}", wait=False)
        yield pools
    finally:
        for pool in pools.values():
            pool.shutdown()


def test_the_engine_samples_with_the_newest_adapter_and_its_log_probs_equal_the_trainers(lora_engines):
    trainer = inprocess_trainer(sgd_config(model=MODEL, lora=LORA))
    model = trainer.megatron.chunks[0].module
    base, first = trainer.full_parameters(), random_adapters(trainer, 1, scale=0.3)
    engines = lora_engines["policy"]
    engines.wait_started()
    try:
        engine = engines.engines[0]
        full_load = ray.get(engine.update_weights.remote(1, _weights(base, first)), timeout=120)
        sampling = SamplingConfig(max_tokens=16, seed=4)
        generations = engines.generate(PROMPTS, sampling)
        assert {g.policy_version for g in generations} == {1}
        trainer.load_full_parameters(first)
        expected = response_log_probs(model, generations)
        for got, want in zip(generations, expected):
            np.testing.assert_allclose(got.response_log_probs, want, atol=1e-4, rtol=0)

        second = random_adapters(trainer, 2, scale=0.3)
        adapter_load = ray.get(engine.update_weights.remote(2, _weights({}, second)), timeout=120)
        assert adapter_load.num_bytes < full_load.num_bytes / 5  # the base did not travel again
        generations = engines.generate(PROMPTS, sampling)
        assert {g.policy_version for g in generations} == {2}
        stale = response_log_probs(model, generations)  # the first adapter's view of the same tokens
        trainer.load_full_parameters(second)
        for got, want, old in zip(generations, response_log_probs(model, generations), stale):
            np.testing.assert_allclose(got.response_log_probs, want, atol=1e-4, rtol=0)
            assert np.abs(got.response_log_probs - old).max() > 1e-2  # sampled with the second, not the first
        # The adapter's PEFT files sit in a directory of the engine's own, which it removes before it ends.
        files = engine_files_dirs(engines.files_name, engines.names[0])[1]
        assert os.listdir(files)
        ray.get(engine.remove_files.remote(), timeout=60)  # what the pool's shutdown asks of every engine
        assert not os.path.exists(files)
    finally:
        engines.shutdown()


def test_one_engine_serves_two_tenants_each_with_its_own_adapter_and_version(lora_engines):
    config, _ = _tenant_adapters()
    trainer = inprocess_trainer(config)
    model = trainer.megatron.chunks[0].module
    adapters = random_adapters(trainer, 5, scale=0.3)
    trainer.load_full_parameters(adapters)
    engines = lora_engines["tenants"]
    engines.wait_started()
    try:
        engine = engines.engines[0]
        math = {name: a for name, a in adapters.items() if ".lora.math." in name}
        code = {name: a for name, a in adapters.items() if ".lora.code." in name}
        ray.get(engine.update_weights.remote(0, _weights(trainer.full_parameters(), math)), timeout=120)
        ray.get(engine.update_weights.remote(3, _weights({}, code)), timeout=120)  # code's own step count
        sampling = SamplingConfig(max_tokens=12, seed=9)
        for tenant, version in (("math", 0), ("code", 3)):
            generations = engines.generate(PROMPTS, sampling, adapter=tenant)
            assert {g.policy_version for g in generations} == {version}
            assert ray.get(engine.current_policy_version.remote(tenant)) == version
            trainer.megatron.activate(tenant)
            for got, want in zip(generations, response_log_probs(model, generations)):
                np.testing.assert_allclose(got.response_log_probs, want, atol=1e-4, rtol=0)
        with pytest.raises(EngineError, match=r"adapter 'chat' is not served here; adapters: \['code', 'math'\]"):
            engines.generate(PROMPTS, sampling, adapter="chat")
        # A killed engine cannot remove its files: the pool's shutdown does, on its node.
        ray.kill(engine, no_restart=True)
        files = engine_files_dirs(engines.files_name, engines.names[0])[1]
        assert sorted(f.split("-")[0] for f in os.listdir(files)) == ["code", "math"]  # each adapter's, left
    finally:
        engines.shutdown()
    assert not any(os.path.exists(d) for d in pool_files_dirs(engines.files_name))
