"""Staleness 0 through the real path: a vLLM engine samples with the train group's weights, the
train group trains those samples, and its recomputed (proximal) log-probs equal the engine's
behaviour log-probs to 1e-3 on average (the step's `log_prob_mismatch` metric).

Real Ray, real Megatron (gloo, CPU), real vLLM CPU engine, loaded from the group's own export.
"""

from __future__ import annotations

import numpy as np
import pytest
import ray
import torch

from trainer.hf_checkpoint import write_hf_checkpoint
from actors.rollout_engine import EngineConfig, RolloutEnginePool
from trainer.config import LossConfig, ModelConfig
from actors.weight_sync import publish_weights
from tests.train_support import sgd_config
from vgbs_ray.agents import SamplingConfig
from vgbs_ray.config import BatchConfig, ParallelConfig
from vgbs_ray.sample import make_rollout
from vgbs_ray.layout.schedule import build_dp_schedule
from vgbs_ray.layout.shard import build_step_shards

pytestmark = pytest.mark.slow  # a train group and a vLLM engine: tens of seconds on 2 cores

MODEL = ModelConfig(seed=11)
PROMPTS = [[3, 14, 15, 92, 65], [1, 2], list(range(40, 71)), [7] * 9, [100, 101, 102], list(range(5, 25))]


def _engine_dtypes(engines) -> tuple[str, set[str]]:
    """The engine's configured compute dtype and the dtypes of its loaded parameters (read inside the actor)."""

    def read(engine):
        def parameter_dtypes(worker):
            return sorted({str(p.dtype) for p in worker.model_runner.model.parameters()})

        [dtypes] = engine.llm.collective_rpc(parameter_dtypes)
        return str(engine.llm.llm_engine.model_config.dtype), set(dtypes)

    return ray.get(engines.engines[0].__ray_call__.remote(read), timeout=60)


def test_at_staleness_zero_the_trainers_log_probs_equal_the_engines(ray_session, tmp_path):
    from actors.train_group import TrainGroup

    config = sgd_config(model=MODEL, loss=LossConfig(policy="decoupled_ppo"))
    group = TrainGroup(config)
    engines = None
    try:
        v0 = publish_weights(group, 0)
        model_dir = write_hf_checkpoint(tmp_path / "policy_v0", MODEL,
                                        {k: torch.from_numpy(v) for k, v in ray.get(v0.ref).items()})
        engines = RolloutEnginePool(EngineConfig(num_engines=1, max_model_len=MODEL.max_position_embeddings),
                                    str(model_dir))
        # The 1e-3 holds for float32 on both sides; a bfloat16 engine would be off by ~1e-2.
        assert _engine_dtypes(engines) == ("torch.float32", {"torch.float32"})
        generations = engines.generate(PROMPTS, SamplingConfig(max_tokens=20, seed=3))
        assert [g.policy_version for g in generations] == [0] * len(PROMPTS)

        rng = np.random.default_rng(0)
        rewards = rng.random(len(generations) // 2)
        samples = []
        for r, reward in enumerate(rewards):  # two turns (samples) per rollout, siblings share its reward
            rows = [dict(tokens=np.concatenate([g.prompt_token_ids, g.response_token_ids]),
                         response_length=len(g.response_token_ids),
                         loss_mask=np.ones(len(g.response_token_ids), np.int8),
                         rollout_log_probs=g.response_log_probs, policy_version_min=g.policy_version,
                         policy_version_max=g.policy_version)
                    for g in generations[2 * r:2 * r + 2]]
            samples += make_rollout(f"r{r}", rows, reward=float(reward), advantage=float(reward - rewards.mean()))
        schedule = build_dp_schedule([s.total_length for s in samples], [s.rollout_id for s in samples],
                                     ParallelConfig(dp_size=1),
                                     BatchConfig(global_batch_size=len(rewards), max_tokens_per_gpu=64))
        shards = build_step_shards(samples, schedule.steps[0], 0)
        assert shards[0].num_microbatches >= 2  # proximal log-probs come from several packed rows
        result = group.train_shards(shards)
    finally:
        if engines is not None:
            engines.shutdown()
        group.shutdown()

    assert set(result.metric_pairs) == {"loss", "reward", "clip_fraction", "ratio", "approx_kl", "is_weight",
                                        "is_truncated", "log_prob_mismatch"}
    tokens = sum(len(g.response_token_ids) for g in generations)
    mismatch, count = result.metric_pairs["log_prob_mismatch"]
    assert count == tokens  # every response token measured
    print(f"log_prob_mismatch (mean |trainer - engine| per token, float32): {mismatch / count:.3e}")
    assert mismatch / count < 1e-3
    assert result.metrics["is_weight"] == pytest.approx(1.0, abs=1e-3)
    assert result.metrics["is_truncated"] == 0
