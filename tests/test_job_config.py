"""The job's configuration: defaults, overrides, start-up errors, and cluster.yaml vs docs/cluster.md."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest
import yaml

from jobs.job_config import JobConfig, load_job_config, options_help, synthetic_preset
from jobs.train import check_cluster_fits
from vgbs_ray.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_embedded_default_is_the_tiny_local_run():
    config = load_job_config()
    assert config.run.ray_address == "local"
    assert config.train.backend == "gloo" and config.train.dp_size == 2
    assert config.scheduler.batch.global_batch_size == 64 and config.scheduler.batch.leftover == "partial"
    # The closed loop is the default: the digit agent's tokenizer is the vocabulary, staleness 1 with its correction.
    from transformers import AutoTokenizer

    assert config.rollout.use_engines and config.rollout.agent == "examples.digit_agent:make_agent"
    assert config.train.model.vocab_size == len(AutoTokenizer.from_pretrained(ROOT / config.rollout.tokenizer_dir))
    assert config.train.loss.off_policy.max_staleness == 1
    assert config.train.loss.policy == "decoupled_ppo"


def test_the_synthetic_preset_is_a_whole_config_and_explicit_keys_still_win():
    config = load_job_config(None, preset="synthetic")
    assert config == synthetic_preset() == load_job_config(None, ["preset=synthetic"])
    assert not config.rollout.use_engines
    assert config.scheduler.batch.global_batch_size == 8 and config.run.num_steps == 8
    assert config.train.loss.policy == "ppo" and config.train.loss.off_policy.max_staleness == 0
    assert config.scheduler_with_model_limits().max_staleness is None  # synthetic rollouts carry no versions
    assert config.train.model.vocab_size == 128  # the synthetic agent's default vocabulary
    # One rollout source: the synthetic preset is an agent like any other, with no tokenizer and no engines.
    assert config.rollout.agent == "examples.synthetic_agent:make_agent"
    assert config.rollout.prompts == "examples.synthetic_agent:make_prompts"
    assert config.rollout.tokenizer_dir is None and config.rollout.num_prompts == 30
    assert 0 < config.rollout.sample_push_fraction < 1
    assert config.train.optimizer.lr_schedule.lr == 1e-4
    mine = load_job_config(None, ["preset=synthetic", "scheduler.batch.global_batch_size=6"])
    assert mine.scheduler.batch.global_batch_size == 6 and mine.run.num_steps == 8
    # Engines off on the closed-loop preset is only that: no other default changes (with an agent that makes
    # its own samples; the digit agent samples the engines, which is refused).
    own_samples = ["rollout.use_engines=false", "rollout.agent=examples.synthetic_agent:make_agent"]
    engines_off = load_job_config(None, own_samples)
    assert engines_off == replace(JobConfig(), rollout=replace(
        JobConfig().rollout, use_engines=False, agent="examples.synthetic_agent:make_agent"))
    assert engines_off.scheduler_with_model_limits().max_staleness is None
    # The closed loop hands the loss's bound to the scheduler.
    assert load_job_config().scheduler_with_model_limits().max_staleness == 1


def test_overrides_change_only_the_named_keys():
    config = load_job_config(None, ["scheduler.batch.global_batch_size=6", "train.model.hidden_size=32",
                                    "rollout.agent_kwargs.max_samples_per_rollout=2"])
    assert config.scheduler.batch.global_batch_size == 6
    assert config.scheduler.batch.max_tokens_per_gpu == 512  # kept from the default
    assert config.train.model.hidden_size == 32 and config.train.model.num_layers == 2
    assert config.rollout.agent_kwargs == {"max_samples_per_rollout": 2}


def test_lora_and_a_float_written_without_a_dot_reach_the_train_group():
    config = load_job_config(None, ["train.lora.rank=8", "train.lora.target_modules=[q_proj, v_proj]",
                                    "train.optimizer.lr_schedule.lr=5e-3"])  # PyYAML reads 5e-3 as a string
    assert config.train.lora.rank == 8 and config.train.lora.target_modules == ("q_proj", "v_proj")
    assert config.train.optimizer.lr_schedule.lr == 0.005
    assert load_job_config(None, []).train.lora is None


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["run.stepz=3"], r"unknown config key\(s\) \['run.stepz'\].*num_steps"),
        (["train.model.hiden_size=3"], r"train.model.hiden_size"),
        (["scheduler.batch.max_tokens_per_gpu=null", "scheduler.batch.micro_batch_size=3"],
         r"step_size % \(dp_size \* micro_batch_size \* mb_group\) == 0"),
        (["scheduler.batch.global_batch_size=1"], r"global_batch_size=1 rollouts is fewer than"),
        (["preset=synthetic", "scheduler.max_staleness=1"],
         r"'scheduler.max_staleness' is not set by hand: the job derives it from train.loss.off_policy.max_staleness"),
        (["scheduler.retain_until_checkpoint=true"], r"'scheduler.retain_until_checkpoint' .* from run.max_failures"),
        (["scheduler.intake.vocab_size=7"], r"'scheduler.intake.vocab_size' .* from train.model.vocab_size"),
        (["scheduler.batch.flops_model.num_layers=7"], r"'scheduler.batch.flops_model' .* from train.model"),
        (["preset=nope"], r"preset 'nope' is unknown; pick one of \['closed_loop', 'long_tail', 'synthetic', 'tool_use'\]"),
        (["rollout.num_prompts=0"], r"rollout.num_prompts must be an integer >= 1"),
        (["rollout.weight_sync.dtype=bfloat16"], r"dtype=bfloat16 needs weight_sync.transport=collective"),
        (["rollout.weight_sync.transport=rdma"], r"transport must be object_store or collective"),
        (["rollout.sample_push_fraction=2"], r"rollout.sample_push_fraction must be in \[0, 1\]"),
        (["rollout.group_size=1"], r"rollout.group_size must be >= 2"),
        (["rollout.agent=my_agents.make"], r"rollout.agent='my_agents.make' must be an import path"),
        (["rollout.dataset.path=prompts.csv"], r"cannot tell the format.*rollout.dataset.format"),
        (["rollout.prompts=null"], r"rollout needs prompts"),
        (["closed_loop.num_prompts=4"], r"config key .closed_loop. moved: set rollout.<key>.*rollout.use_engines"),
        (["train.tp_size=3"], r"tp_size=3 must divide"),
        (["scheduler.batch.balance=fast"], r"balance must be one of"),
        (["run"], r"section.key=value"),
    ],
)
def test_wrong_configs_fail_at_start_up_with_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_job_config(None, overrides)


def test_off_policy_keys_reach_the_loss_and_bad_combinations_fail():
    config = load_job_config(None, ["train.loss.policy=decoupled_ppo", "train.loss.off_policy.max_staleness=2",
                                    "train.loss.policy_kwargs.is_weight_cap=3.0"])
    loss = config.train.loss
    assert (loss.policy, loss.off_policy.max_staleness, loss.policy_kwargs) == ("decoupled_ppo", 2, {"is_weight_cap": 3.0})
    with pytest.raises(ConfigError, match=r"max_staleness=2 .*'ppo' has no off-policy correction"):
        load_job_config(None, ["train.loss.policy=ppo", "train.loss.off_policy.max_staleness=2"])
    # the loss's knobs moved under train.loss: the old keys are refused, naming the new place
    with pytest.raises(ConfigError, match=r"'train.loss.off_policy.policy_loss' moved: set train.loss.policy"):
        load_job_config(None, ["train.loss.off_policy.policy_loss=ppo"])
    with pytest.raises(ConfigError, match=r"'train.loss.off_policy.clip_eps' moved: set train.loss.policy_kwargs.clip_eps"):
        load_job_config(None, ["train.loss.off_policy.clip_eps=0.1"])
    with pytest.raises(ConfigError, match=r"policy='decoupled_ppo': policy_kwargs \['clip'\] do not fit .*clip_eps"):
        load_job_config(None, ["train.loss.policy_kwargs.clip=0.1"])


def test_flops_balance_weighs_sequences_by_the_policys_own_dimensions_and_help_lists_no_derived_key():
    config = load_job_config(None, ["scheduler.batch.balance=flops", "train.model.num_layers=3"])
    flops = config.scheduler.batch.flops_model
    model = config.train.model
    assert config.scheduler.batch.balance == "flops"
    assert (flops.num_layers, flops.hidden_size, flops.vocab_size) == (3, model.hidden_size, model.vocab_size)
    assert load_job_config(None, []).scheduler.batch.flops_model is None  # tokens balance: no cost model
    listed = options_help()
    for key in ("scheduler.max_staleness", "scheduler.retain_until_checkpoint", "scheduler.intake.vocab_size",
                "scheduler.batch.flops_model", "scheduler.features"):
        assert f"  {key}" not in listed
    assert "  scheduler.intake.max_sequence_length" in listed  # a user may tighten it below the model's


def test_keys_of_the_removed_layout_path_are_refused_saying_why():
    with pytest.raises(ConfigError, match=r"'scheduler.features' was removed: every step is laid out on the rollout side"):
        load_job_config(None, ["scheduler.features=[multimodal]"])
    with pytest.raises(ConfigError, match=r"'train.loss.legacy_max_tokens_per_microbatch' was removed: .*"
                                          r"scheduler.batch.max_tokens_per_gpu"):
        load_job_config(None, ["train.loss.legacy_max_tokens_per_microbatch=512"])


def test_parallel_sizes_the_cluster_cannot_hold_fail_before_any_actor():
    config = load_job_config(None, ["train.dp_size=4", "train.tp_size=2"])
    with pytest.raises(ConfigError, match=r"needs 8 CPU .* cluster has 4"):
        check_cluster_fits(config, {"CPU": 4.0})
    check_cluster_fits(config, {"CPU": 8.0})
    gpu = load_job_config(None, ["train.backend=nccl"])
    with pytest.raises(ConfigError, match="GPU"):
        check_cluster_fits(gpu, {"CPU": 64.0})


def test_help_lists_every_option_with_its_doc():
    text = options_help()
    for key in ("run.num_steps", "scheduler.batch.global_batch_size", "train.model.hidden_size",
                "rollout.group_size", "rollout.num_prompts", "scheduler.max_steps_ahead"):
        assert key in text
    assert "Rollouts per optimizer step (not samples)." in text
    result = subprocess.run([sys.executable, "-m", "jobs.train", "--help"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "scheduler.batch.global_batch_size" in result.stdout


def test_a_bad_config_exits_with_a_message_not_a_traceback():
    result = subprocess.run([sys.executable, "-m", "jobs.train", "--set", "run.bogus=1"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "config error: unknown config key(s) ['run.bogus']" in result.stderr
    assert "Traceback" not in result.stderr


def test_cluster_yaml_names_the_setup_the_cluster_page_describes():
    cluster = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    readme = (ROOT / "docs" / "cluster.md").read_text()  # the page the README sends cluster users to
    assert "docs/cluster.md" in (ROOT / "README.md").read_text()
    head = cluster["available_node_types"][cluster["head_node_type"]]
    workers = {name: node for name, node in cluster["available_node_types"].items() if name != cluster["head_node_type"]}
    assert "GPU" not in head["resources"]
    gpus = sum(node["resources"]["GPU"] * node["min_workers"] for node in workers.values())
    # The job config the README points cluster users at fills exactly those GPUs.
    job = load_job_config(str(ROOT / "jobs/configs/cluster_16gpu.yaml"))
    assert job.train.backend == "nccl" and job.train.world_size == gpus
    assert "pip install -e ." in " ".join(cluster["setup_commands"])
    for name in workers:
        assert name in readme
    assert "ray up cluster.yaml" in readme and "jobs/configs/cluster_16gpu.yaml" in readme
    assert f"{gpus} GPUs" in readme


def test_the_tokenizer_size_read_without_transformers_is_transformers_count(tmp_path):
    """vgbs_ray.checkpoint_files.tokenizer_size reads tokenizer.json; transformers' len() is the reference,
    for the digit tokenizer, a BPE one with special tokens, and one with a token added after training."""
    from transformers import AutoTokenizer

    from tests.agent_support import bpe_chat_tokenizer
    from vgbs_ray.checkpoint_files import tokenizer_size

    bpe = bpe_chat_tokenizer()
    bpe.save_pretrained(tmp_path / "bpe")
    bpe.add_tokens(["<tool_call>", "</tool_call>"], special_tokens=True)
    bpe.save_pretrained(tmp_path / "added")
    for directory in (ROOT / "examples" / "digit_tokenizer", tmp_path / "bpe", tmp_path / "added"):
        assert tokenizer_size(directory) == len(AutoTokenizer.from_pretrained(directory)), directory
    assert tokenizer_size(tmp_path / "added") == tokenizer_size(tmp_path / "bpe") + 2


@pytest.mark.parametrize("model_type", [None, "llama", "qwen2", "qwen3", "qwen3_moe"])
def test_load_tokenizer_gives_what_auto_tokenizer_gives(tmp_path, model_type):
    """vgbs_ray.checkpoint_files.load_tokenizer takes a shortcut past AutoTokenizer for a TokenizersBackend
    tokenizer: the same class and the same ids, chat rendering and special tokens as AutoTokenizer, for the digit
    tokenizer and a BPE one with a token added after training, alone or beside a model config of each family
    (qwen2's is AutoTokenizer's own path: it picks Qwen2Tokenizer)."""
    from transformers import AutoTokenizer

    from tests.agent_support import bpe_chat_tokenizer
    from vgbs_ray.checkpoint_files import AUTO_TOKENIZER_KEEPS_BACKEND, load_tokenizer

    bpe = bpe_chat_tokenizer()
    bpe.add_tokens(["<tool_call>"], special_tokens=True)
    bpe.save_pretrained(tmp_path / "added")
    shutil.copytree(ROOT / "examples" / "digit_tokenizer", tmp_path / "digit")
    chat = [{"role": "user", "content": "what is 3 + 4?"}, {"role": "assistant", "content": "it is 7."},
            {"role": "user", "content": "3 4"}]
    text = "<tool_call> what is 12 + 9? 3 4"
    for directory in (tmp_path / "digit", tmp_path / "added"):
        if model_type is not None:
            (directory / "config.json").write_text(json.dumps({"model_type": model_type}))
        loaded, reference = load_tokenizer(directory), AutoTokenizer.from_pretrained(directory)
        assert type(loaded) is type(reference), directory
        assert (type(reference).__name__ == "TokenizersBackend") == (model_type in AUTO_TOKENIZER_KEEPS_BACKEND | {None})
        assert len(loaded) == len(reference) and loaded.all_special_ids == reference.all_special_ids
        assert loaded.eos_token_id == reference.eos_token_id and loaded.pad_token_id == reference.pad_token_id
        assert (loaded.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)["input_ids"]
                == reference.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)["input_ids"])
        assert loaded.encode(text) == reference.encode(text)
        assert loaded.decode(loaded.encode(text)) == reference.decode(reference.encode(text))


def test_a_tokenizer_larger_than_the_models_vocabulary_fails_before_any_actor(monkeypatch):
    from jobs.train import check_tokenizer_fits

    monkeypatch.chdir(ROOT)
    check_tokenizer_fits(load_job_config())  # the demo's own: fits exactly
    with pytest.raises(ConfigError, match=r"has 17 tokens but train.model.vocab_size=16"):
        check_tokenizer_fits(load_job_config(None, ["train.model.vocab_size=16"]))
    with pytest.raises(ConfigError, match=r"tokenizer_dir='nowhere' is not a directory"):
        check_tokenizer_fits(load_job_config(None, ["rollout.tokenizer_dir=nowhere"]))


def test_a_loss_that_wants_centred_advantages_sets_the_scheduler_so():
    from jobs.train import resolve_loss

    dr_grpo = load_job_config(None, ["train.loss.policy=dr_grpo", "train.loss.policy_kwargs.max_response_tokens=16",
                                     "train.loss.off_policy.max_staleness=0"])
    assert dr_grpo.scheduler.intake.advantage_std  # what the user wrote ...
    assert resolve_loss(dr_grpo).scheduler.intake.advantage_std is False  # ... and what the job runs
    default = load_job_config()
    assert resolve_loss(default) == default


def test_turning_the_engines_off_under_an_agent_that_samples_them_is_refused_before_ray():
    with pytest.raises(ConfigError, match=r"rollout.use_engines=false turns the rollout engines off, but "
                                          r"rollout.agent=examples.digit_agent:make_agent samples them.*--preset synthetic"):
        load_job_config(None, ["rollout.use_engines=false"])
    with pytest.raises(ConfigError, match=r"rollout.endpoint.enabled=true serves the rollout engines"):
        load_job_config(None, ["preset=synthetic", "rollout.endpoint.enabled=true"])
    assert not load_job_config(None, ["preset=synthetic"]).rollout.use_engines  # an agent making its own samples


def test_a_run_whose_input_died_is_a_failure_and_one_whose_input_ended_is_not():
    from jobs.summary import input_failure

    def summary(steps, failed, finished, stopped=0):
        return {"steps": steps, "producers": {"failed": failed, "finished": finished, "stopped": stopped,
                                              "restarts": [{"producer": 0}] * failed}}

    assert "every producer failed (2, after 2 restarts): the run trained 0 steps" in input_failure(summary(0, 2, 0), 100)
    assert "1 producer(s) failed and the run trained 3 of run.num_steps=100" in input_failure(summary(3, 1, 1), 100)
    assert input_failure(summary(8, 0, 2), 100) is None  # prompts ended by design: a shorter run, not a failure
    assert input_failure(summary(100, 1, 1), 100) is None  # a producer lost, every step trained


def test_a_hold_for_slow_rollouts_as_long_as_the_shard_timeout_is_refused_naming_both_keys():
    with pytest.raises(ConfigError, match=r"scheduler.max_hold_s=120.0 s .*run.shard_timeout_s=120.0 s"):
        load_job_config(None, ["scheduler.max_hold_s=120.0"])
    assert load_job_config().scheduler.max_hold_s < load_job_config().run.shard_timeout_s


def test_tenants_take_the_jobs_sections_as_defaults_and_refuse_what_they_cannot_do():
    config = load_job_config(None, ["run.num_steps=7", "tenants=[{name: a}, {name: b, global_batch_size: 16, "
                                    "num_steps: 3, agent: 'm:f', lora: {rank: 4}}]"])
    a, b = config.tenant_view(0), config.tenant_view(1)
    assert (a.run.num_steps, a.scheduler.batch.global_batch_size, a.rollout.agent) == (
        7, config.scheduler.batch.global_batch_size, config.rollout.agent)
    assert (b.run.num_steps, b.scheduler.batch.global_batch_size, b.rollout.agent) == (3, 16, "m:f")
    assert a.rollout.seed != b.rollout.seed and a.run.output_dir.endswith("tenants/a")
    assert [(t.name, t.lora.rank) for t in a.train.tenant_adapters] == [("a", 8), ("b", 4)]
    for extra, key in ((["train.lora.rank=8"], "train.lora"),
                       (["rollout.endpoint.enabled=true"], "rollout.endpoint.enabled")):
        with pytest.raises(ConfigError, match=rf"\['{key}'\] are not supported with tenants"):
            load_job_config(None, ["tenants=[{name: a}]", *extra])
    # a tenant's own keys are checked as the job's would be, naming the tenant (a tenant always has prompts: it
    # takes the job's rollout.prompts or dataset, which the job requires)
    with pytest.raises(ConfigError, match=r"tenants\[b\]: rollout.agent='no_colon' must be an import path"):
        load_job_config(None, ["tenants=[{name: a}, {name: b, agent: no_colon}]"])
    with pytest.raises(ConfigError, match=r"two tenants named alike: \['a', 'a'\]"):
        load_job_config(None, ["tenants=[{name: a}, {name: a}]"])
    with pytest.raises(ConfigError, match=r"tenants\[b\].global_batch_size must be an integer >= 1, got 0"):
        load_job_config(None, ["tenants=[{name: a}, {name: b, global_batch_size: 0}]"])


def test_round_robin_goes_to_the_least_recently_trained_tenant_with_a_ready_step():
    from jobs.tenants import round_robin_choice

    assert round_robin_choice(["a", "b", "c"], {"b", "c"}) == "b"
    assert round_robin_choice(["c", "a", "b"], {"a", "b", "c"}) == "c"
    assert round_robin_choice(["a", "b"], set()) is None
