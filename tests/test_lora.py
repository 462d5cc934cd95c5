"""LoRA on the Megatron trainer: exactness at start, only adapters train, TP/DP invariance, PEFT files that peft loads.

In-process ranks (a world-size-1 gloo group) and two spawned gloo ranks for TP=2, DP=2 and PP=2 (one spawn); the
Hugging Face side is transformers + peft on tiny random checkpoints made in code.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

from trainer.config import TrainGroupConfig
from tests.hf_support import megatron_logits, model_config_for, tiny_hf_model
from tests.train_support import (inprocess_trainer, layout_shards, make_samples, process_groups_in_turn,
                                 run_two_ranks, sgd_config)
from vgbs_ray.errors import ConfigError
from vgbs_ray.models.lora import (AdapterMismatchError, LoraConfig, base_model_name, load_peft_adapter,
                           merge_into_hf_weights, save_peft_adapter)

LORA = LoraConfig(rank=4, alpha=8.0)
ATTENTION_LORA = dataclasses.replace(LORA, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))


def random_adapters(trainer, seed: int, scale: float = 0.05) -> dict[str, np.ndarray]:
    """Whole-model adapters with B non-zero too (at start B = 0, which hides a wrong B layout)."""
    rng = np.random.default_rng(seed)
    return {name: (scale * rng.standard_normal(a.shape)).astype(np.float32)
            for name, a in trainer.full_parameters(adapters=True).items()}


def one_step_shards(samples, dp_size: int):
    return layout_shards(samples, dp_size=dp_size, max_tokens=160)


# -- config ------------------------------------------------------------------------------------

def test_bad_lora_configs_are_refused_naming_the_key_and_the_valid_values():
    with pytest.raises(ConfigError, match=r"\['qkv'\] are not modules of the model; valid: \['q_proj'"):
        LoraConfig(target_modules=("q_proj", "qkv"))
    with pytest.raises(ConfigError, match="rank must be a positive integer, got 0"):
        LoraConfig(rank=0)
    with pytest.raises(ConfigError, match="alpha must be > 0, got -1"):
        LoraConfig(alpha=-1)
    with pytest.raises(ConfigError, match="each target once"):
        LoraConfig(target_modules=("q_proj", "q_proj"))


def test_lora_on_the_experts_of_a_mixture_of_experts_is_refused_with_the_reason(tmp_path):
    tiny_hf_model(tmp_path, "qwen3_moe")
    model = model_config_for(tmp_path)
    with pytest.raises(ConfigError, match=r"mixture of experts.*\['gate_proj', 'up_proj', 'down_proj'\].*"
                                          r"target_modules=\['q_proj', 'k_proj', 'v_proj', 'o_proj'\]"):
        TrainGroupConfig(model=model, lora=LoraConfig())
    TrainGroupConfig(model=model, lora=LoraConfig(target_modules=("q_proj", "k_proj", "v_proj", "o_proj")))


# -- the trainer -------------------------------------------------------------------------------

@pytest.mark.parametrize("targets", [LORA.target_modules, ("q_proj", "v_proj", "up_proj")])
def test_adapters_at_start_give_the_base_models_logits_exactly(targets):
    from trainer.model import build_gpt_model

    config = sgd_config(lora=dataclasses.replace(LORA, target_modules=targets))
    trainer = inprocess_trainer(config)
    base = build_gpt_model(config.model)
    tokens = list(range(3, 40))
    assert torch.equal(megatron_logits(trainer.megatron.chunks[0].module, tokens), megatron_logits(base, tokens))


def test_a_step_trains_the_adapters_and_leaves_every_base_weight_bit_identical():
    trainer = inprocess_trainer(sgd_config(lora=LORA))
    trainer.load_full_parameters(random_adapters(trainer, 1))
    base, adapters = trainer.full_parameters(), trainer.full_parameters(adapters=True)
    trainable = [name for name, p in trainer.megatron.chunks[0].module.named_parameters() if p.requires_grad]
    assert trainable and all(".lora." in name for name in trainable)
    trainer.train_shard(one_step_shards(make_samples(3, 6), 1)[0])
    after = trainer.full_parameters()
    assert all(np.array_equal(base[name], after[name]) for name in base)
    moved = {name: float(np.abs(a - adapters[name]).max()) for name, a in trainer.full_parameters(adapters=True).items()}
    assert all(change > 0 for change in moved.values()), moved  # A and B of every target


LAYOUTS = {"tp": (2, 1, 1), "dp": (1, 2, 1), "pp": (1, 1, 2)}
"""(tp_size, dp_size, pp_size) of each two-rank layout."""


def _lora_step_worker(rank: int, ports: list[int], samples, start: dict, results) -> None:
    """Spawned: for each of LAYOUTS in turn (a process group of its own each, on its port of `ports`), two
    ranks train one LoRA step from `start`; rank 0 reports, per layout, the logits before (TP: gathered; PP: None)
    and the adapters after (gathered over the stages). One spawn for all three: a spawn costs more than a step."""
    try:
        torch.set_num_threads(1)
        from trainer.rank_trainer import RankTrainer

        reports = {}
        groups = process_groups_in_turn(rank, ports, [(tp, pp) for tp, _, pp in LAYOUTS.values()])
        for (layout, (tp_size, dp_size, pp_size)), info in zip(LAYOUTS.items(), groups):
            trainer = RankTrainer(sgd_config(lora=LORA, tp_size=tp_size, dp_size=dp_size, pp_size=pp_size), info)
            trainer.load_full_parameters(start)
            logits = None
            if pp_size == 1:
                logits = megatron_logits(trainer.megatron.chunks[0].module, list(range(3, 30))).contiguous()
            if tp_size == 2:  # the vocabulary is split over TP ranks
                parts = [torch.empty_like(logits) for _ in range(2)]
                torch.distributed.all_gather(parts, logits)
                logits = torch.cat(parts, dim=-1)
            trainer.train_shard(one_step_shards(samples, dp_size)[info.dp_rank])
            adapters = trainer.full_parameters(adapters=True)
            reports[layout] = (None if logits is None else logits.numpy(), adapters)
        results.put((rank, reports if rank == 0 else None, None))
    except BaseException as error:  # report, never hang the parent
        results.put((rank, None, repr(error)))
    finally:
        results.close()
        results.join_thread()
        os._exit(0)


@pytest.fixture(scope="module")
def one_rank_and_layouts():
    """The step at one rank (logits before, adapters before and after) and rank 0's report of every layout."""
    samples = make_samples(5, 8)
    trainer = inprocess_trainer(sgd_config(lora=LORA))
    start = {**trainer.full_parameters(), **random_adapters(trainer, 2)}
    trainer.load_full_parameters(start)
    expected_logits = megatron_logits(trainer.megatron.chunks[0].module, list(range(3, 30))).numpy()
    before = trainer.full_parameters(adapters=True)
    trainer.train_shard(one_step_shards(samples, 1)[0])
    expected = trainer.full_parameters(adapters=True)
    (_, reports, _), _ = run_two_ranks(_lora_step_worker, len(LAYOUTS), samples, start)
    return expected_logits, before, expected, reports


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_lora_step_at_tp2_dp2_and_pp2_equals_the_step_at_one_rank(one_rank_and_layouts, layout):
    expected_logits, before, expected, reports = one_rank_and_layouts
    logits, adapters = reports[layout]
    if logits is not None:  # pp: the stages' logits are not one rank's
        np.testing.assert_allclose(logits, expected_logits, atol=2e-5, rtol=0)
    for name in expected:
        update, got = expected[name] - before[name], adapters[name] - before[name]
        assert np.linalg.norm(got - update) <= 1e-5 * np.linalg.norm(update) + 1e-7, name


# -- PEFT files --------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", ["llama3_tied", "qwen2", "qwen3_untied", "qwen3_moe"])
def test_the_adapter_files_load_in_peft_with_the_trainers_logits(tmp_path, shape):
    from peft import PeftModel

    hf_model = tiny_hf_model(tmp_path / "base", shape)
    model = model_config_for(tmp_path / "base")
    lora = LORA if model.num_experts is None else ATTENTION_LORA  # the experts take no adapters
    trainer = inprocess_trainer(TrainGroupConfig(model=model, lora=lora))
    trainer.load_full_parameters(random_adapters(trainer, 3, scale=0.2))
    adapters = trainer.full_parameters(adapters=True)
    save_peft_adapter(str(tmp_path / "adapter"), adapters, lora, base_model_name(model))
    tokens = [5, 17, 3, 60, 2, 9, 41, 7]
    trained = megatron_logits(trainer.megatron.chunks[0].module, tokens)
    with torch.no_grad():
        base_logits = hf_model(torch.tensor([tokens])).logits[0]
        peft_logits = PeftModel.from_pretrained(hf_model, str(tmp_path / "adapter")).eval()(
            torch.tensor([tokens])).logits[0]
    assert float((trained - base_logits).abs().max()) > 1e-2  # the adapter changes the model
    assert torch.allclose(trained, peft_logits, atol=1e-4, rtol=0), float((trained - peft_logits).abs().max())

    # merged into a full checkpoint: the same logits without peft
    from trainer.hf_checkpoint import read_hf_weights, write_hf_checkpoint

    hf = {name: t.numpy() for name, t in read_hf_weights(tmp_path / "base").items()}
    merged = merge_into_hf_weights(hf, adapters, lora)
    write_hf_checkpoint(tmp_path / "merged", model, {name: torch.from_numpy(a) for name, a in merged.items()})
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        merged_logits = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()(
            torch.tensor([tokens])).logits[0]
    assert torch.allclose(trained, merged_logits, atol=1e-4, rtol=0)


def test_an_adapter_for_another_base_is_refused_naming_both(tmp_path):
    from trainer.lora_layers import adapter_shapes

    small = sgd_config().model
    large = dataclasses.replace(small, hidden_size=256)
    trainer = inprocess_trainer(sgd_config(lora=LORA))
    save_peft_adapter(str(tmp_path), trainer.full_parameters(adapters=True), LORA, base_model_name(small))
    lora, tensors = load_peft_adapter(str(tmp_path), expected_shapes=adapter_shapes(LORA, small),
                                      base_model_name_or_path=base_model_name(small))
    assert lora.rank == LORA.rank and set(tensors) == set(adapter_shapes(LORA, small))
    with pytest.raises(AdapterMismatchError, match=r"made for base 'vgbs-ray:llama-layers2-hidden128.*this model is "
                                                   r"'vgbs-ray:llama-layers2-hidden256"):
        load_peft_adapter(str(tmp_path), expected_shapes=adapter_shapes(LORA, large),
                          base_model_name_or_path=base_model_name(large))


def test_a_lora_checkpoint_holds_the_adapters_and_resumes_to_the_same_model():
    config = TrainGroupConfig(lora=LORA, optimizer=sgd_config().optimizer)
    trainer = inprocess_trainer(config)
    trainer.load_full_parameters(random_adapters(trainer, 4))
    trainer.train_shard(one_step_shards(make_samples(6, 4), 1)[0])
    state = trainer.state_dict()
    assert state["model"][0] and all(".lora." in name for name in state["model"][0])  # not the frozen base
    resumed = inprocess_trainer(config)
    resumed.load_state_dict(state)
    for adapters in (False, True):
        want, got = trainer.full_parameters(adapters=adapters), resumed.full_parameters(adapters=adapters)
        assert all(np.array_equal(want[name], got[name]) for name in want)


def test_training_starts_from_an_adapter_file_made_for_this_base_and_refuses_another(tmp_path):
    trainer = inprocess_trainer(sgd_config(lora=LORA))
    adapters = random_adapters(trainer, 7)
    save_peft_adapter(str(tmp_path / "mine"), adapters, LORA, base_model_name(sgd_config().model))
    started = inprocess_trainer(sgd_config(lora=dataclasses.replace(LORA, adapter_dir=str(tmp_path / "mine"))))
    got = started.full_parameters(adapters=True)
    assert all(np.array_equal(adapters[name], got[name]) for name in adapters)
    other = dataclasses.replace(LORA, rank=2, adapter_dir=str(tmp_path / "mine"))
    with pytest.raises(AdapterMismatchError, match="made for base 'vgbs-ray:llama-layers2-hidden128"):
        inprocess_trainer(sgd_config(lora=other))  # rank 2 shapes: the rank-4 file does not fit


# -- multi-LoRA: one adapter per tenant ---------------------------------------------------------

def _tenants_config(**overrides) -> TrainGroupConfig:
    from trainer.config import AdapterConfig, OptimizerConfig
    from vgbs_ray.lr_schedule import LRScheduleConfig

    adam = OptimizerConfig(kind="adamw", lr_schedule=LRScheduleConfig(lr=1e-2))
    return TrainGroupConfig(tenant_adapters=(
        AdapterConfig(name="math", lora=LORA, optimizer=adam),
        AdapterConfig(name="code", lora=dataclasses.replace(LORA, rank=2, target_modules=("q_proj", "v_proj")),
                      optimizer=dataclasses.replace(adam, lr_schedule=LRScheduleConfig(lr=3e-3)))), **overrides)


def test_a_tenants_step_moves_only_its_adapter_with_its_own_optimizer_and_schedule():
    trainer = inprocess_trainer(_tenants_config())
    samples = make_samples(8, 4)

    def snapshot():
        return {**trainer.full_parameters(), **trainer.full_parameters(adapters=True)}

    for tenant, other in (("math", "code"), ("code", "math"), ("math", "code")):  # Adam's moments: a 2nd math step
        before = snapshot()
        result = trainer.train_shard(one_step_shards(samples, 1)[0], tenant)
        after = snapshot()
        changed = {name for name in before if not np.array_equal(before[name], after[name])}
        assert changed and all(f".lora.{tenant}." in name for name in changed), (tenant, sorted(changed)[:3])
        assert result.lr == {"math": 1e-2, "code": 3e-3}[tenant]
    assert trainer.tenant_consumed == {"math": 8, "code": 4}
    with pytest.raises(ValueError, match=r"adapter 'chat'.*\['code', 'math'\]"):
        trainer.train_shard(one_step_shards(samples, 1)[0], "chat")
    resumed = inprocess_trainer(_tenants_config())
    resumed.load_state_dict(trainer.state_dict())
    assert resumed.tenant_consumed == trainer.tenant_consumed
    for adapter in ("math", "code"):  # the next step of a resumed run equals the uninterrupted one's (Adam state)
        trainer.train_shard(one_step_shards(samples, 1)[0], adapter)
        resumed.train_shard(one_step_shards(samples, 1)[0], adapter)
        want, got = trainer.full_parameters(adapters=True), resumed.full_parameters(adapters=True)
        assert all(np.array_equal(want[name], got[name]) for name in want)


def test_tenant_adapters_are_refused_beside_train_lora_and_under_one_name():
    from trainer.config import AdapterConfig

    with pytest.raises(ConfigError, match="train.lora and tenants both set"):
        _tenants_config(lora=LORA)
    with pytest.raises(ConfigError, match=r"tenant names must differ, got \['a', 'a'\]"):
        TrainGroupConfig(tenant_adapters=(AdapterConfig(name="a", lora=LORA), AdapterConfig(name="a", lora=LORA)))
    with pytest.raises(ConfigError, match="letters, digits and underscores"):
        AdapterConfig(name="my tenant", lora=LORA)


def test_a_tenants_token_versions_are_read_from_the_engines_labels_of_every_adapter():
    from actors.rollout_engine import _merged_runs, _version_of

    assert _version_of("7", None) == 7 and _version_of("7", "policy") == 7  # one adapter: the plain version
    label = '{"code": 3, "math": 5}'
    assert (_version_of(label, "math"), _version_of(label, "code"), _version_of(label, "chat")) == (5, 3, -1)
    # another tenant's load splits vLLM's spans without changing this request's version: one run again
    assert _merged_runs([(5, 4), (5, 2), (6, 3)]) == ((5, 6), (6, 3))


def test_lora_with_context_parallelism_is_refused_naming_the_reason():
    with pytest.raises(ConfigError, match=r"cp_size=2 with LoRA adapters: .*fuse the norm"):
        TrainGroupConfig(lora=LORA, cp_size=2, backend="nccl")
