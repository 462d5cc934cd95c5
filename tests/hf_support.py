"""Tiny random Hugging Face models of every family made in code (nothing is downloaded), and Megatron helpers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from trainer.config import ModelConfig


def tiny_hf_llama(path: Path, *, seed: int = 0, vocab_size: int = 96, hidden_size: int = 128, num_layers: int = 2,
                  num_heads: int = 4, num_kv_heads: int = 2, ffn: int = 192, rope_theta: float = 5000.0,
                  rms_norm_eps: float = 1e-5):
    """A random fp32 `LlamaForCausalLM` saved to `path` (config.json + model.safetensors); returns the model.

    The norms are random too (HF initialises them to ones), so a mapping that swaps the two
    norms of a layer changes the logits.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=ffn,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         max_position_embeddings=256, rms_norm_eps=rms_norm_eps, rope_theta=rope_theta,
                         tie_word_embeddings=False, attn_implementation="eager")
    return _randomized_and_saved(LlamaForCausalLM(config), path)


# The shapes of the small checkpoints people post-train, tiny: (transformers config class, its arguments).
FAMILY_SHAPES = {
    # Llama-3.2-1B: tied embeddings, llama3 RoPE scaling (a short original context, so the scaling
    # changes the frequencies the test positions use).
    "llama3_tied": ("LlamaConfig", dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                        tie_word_embeddings=True,
                                        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 64})),
    # Qwen2.5-0.5B: tied embeddings, QKV biases.
    "qwen2": ("Qwen2Config", dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                  tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # Qwen3-0.6B: tied embeddings, QK-norm, head_dim independent of hidden_size / heads (32 x 4 != 64).
    "qwen3": ("Qwen3Config", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                  tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # Qwen3-30B-A3B: a mixture of experts in every layer (4 experts, top 2, renormalised), QK-norm, untied.
    "qwen3_moe": ("Qwen3MoeConfig", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                         norm_topk_prob=True, tie_word_embeddings=False)),
    # Qwen3-MoE without renormalising the chosen experts' gate weights (`norm_topk_prob=False`), tied.
    "qwen3_moe_unnormed": ("Qwen3MoeConfig", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                                  head_dim=32, num_experts=4, num_experts_per_tok=2,
                                                  moe_intermediate_size=64, norm_topk_prob=False,
                                                  tie_word_embeddings=True)),
    # A larger Qwen3: untied.
    "qwen3_untied": ("Qwen3Config", dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                         tie_word_embeddings=False)),
}


JOB_SHAPES = ("llama3_tied", "qwen2", "qwen3", "qwen3_moe")
"""The shapes tests/test_model_family_jobs.py trains a closed-loop job on (one of each family)."""


def tiny_hf_model(path: Path, shape: str, *, seed: int = 0, vocab_size: int = 96, num_layers: int = 2, ffn: int = 192):
    """A random fp32 model of one of `FAMILY_SHAPES` saved to `path`; returns the model (norms and biases random)."""
    import transformers

    torch.manual_seed(seed)
    config_class, kwargs = FAMILY_SHAPES[shape]
    config = getattr(transformers, config_class)(vocab_size=vocab_size, intermediate_size=ffn,
                                                 num_hidden_layers=num_layers, max_position_embeddings=256,
                                                 rms_norm_eps=1e-5, attn_implementation="eager", **kwargs)
    return _randomized_and_saved(transformers.AutoModelForCausalLM.from_config(config), path)


def _randomized_and_saved(model, path: Path):
    """Norms and biases random too (HF initialises them to ones and zeros), so a mapping that swaps two
    norms or misplaces a bias changes the logits; saved with `save_pretrained`."""
    model = model.float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
    model.save_pretrained(str(path))
    return model


def hf_log_probs(model, tokens: list[int]) -> torch.Tensor:
    """log p(tokens[t] | tokens[:t]) for t >= 1 under a transformers model, one sequence alone ([L - 1])."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]


def assert_logits_match(hf_model, sequences: list, logits: list, atol: float = 1e-4) -> None:
    """Each sequence's Megatron logits ([L, vocab], full vocabulary) equal the transformers model's (fp32)."""
    for tokens, got in zip(sequences, logits, strict=True):
        got = torch.as_tensor(got)
        with torch.no_grad():
            expected = hf_model(torch.tensor([tokens])).logits[0]
        assert got.shape == expected.shape
        assert torch.allclose(got, expected, atol=atol, rtol=0), float((got - expected).abs().max())


def megatron_logits(model, tokens: list[int]) -> torch.Tensor:
    """Unpacked (sbhd) logits of one sequence, [L, vocab / tp]."""
    with torch.no_grad():
        ids = torch.tensor([tokens])
        return model(ids, torch.arange(len(tokens))[None], None)[0].float()


def response_log_probs(model, generations) -> list[np.ndarray]:
    """The trainer's view of engine generations: one THD packed row of prompt + response for every
    generation through the Megatron `model` (TP=1); the log-prob of each response token."""
    from trainer.model import packed_seq_params

    sequences = [np.concatenate([g.prompt_token_ids, g.response_token_ids]) for g in generations]
    lengths = [len(s) for s in sequences]
    cu_seqlens = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    tokens = torch.from_numpy(np.concatenate(sequences))[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        logits = model(tokens, positions, None, packed_seq_params=packed_seq_params(cu_seqlens, max(lengths)))[0]
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    out = []
    for g, start, length in zip(generations, cu_seqlens[:-1].tolist(), lengths):
        rows = torch.arange(start + len(g.prompt_token_ids) - 1, start + length - 1)  # logits that score the response
        out.append(log_probs[rows, torch.from_numpy(g.response_token_ids)].numpy())
    return out


def model_config_for(path: Path, **overrides) -> ModelConfig:
    from trainer.hf_checkpoint import model_config_from_hf

    return model_config_from_hf(path, **overrides)


def tp_rank_worker(rank: int, world_size: int, port: int, runs: list[tuple[str, int]], sequences: list,
                   results) -> None:
    """Spawned per rank: for each (checkpoint directory, ep_size) of `runs` in turn, build the policy at
    TP=world_size / ep_size, EP=ep_size (Megatron's parallel state made again over one process group); rank 0
    reports per run (full-vocabulary logits per sequence, exported HF weights) or an error string. EP ranks run
    the sequences in opposite orders, so their token counts differ at every forward (the alltoall dispatcher's
    case). One spawn for several runs: a rank's start (torch, Megatron, gloo) costs more than a run."""
    import os

    try:
        torch.set_num_threads(1)
        import torch.distributed as dist
        from megatron.core import parallel_state

        from trainer.distributed import init_distributed
        from trainer.hf_checkpoint import export_hf_weights
        from trainer.model import build_gpt_model

        reports = []
        for index, (hf_dir, ep_size) in enumerate(runs):
            tp_size = world_size // ep_size
            if index == 0:
                init_distributed(rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port,
                                 backend="gloo", timeout_s=60, tp_size=tp_size, pp_size=1, cp_size=1, ep_size=ep_size)
            else:
                parallel_state.destroy_model_parallel()
                parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size,
                                                         expert_model_parallel_size=ep_size,
                                                         distributed_timeout_minutes=1.0)
            config = model_config_for(Path(hf_dir))
            model = build_gpt_model(config, tp_size=tp_size, ep_size=ep_size).eval()
            group = parallel_state.get_tensor_model_parallel_group()
            order = list(range(len(sequences)))
            if parallel_state.get_expert_model_parallel_rank() % 2:
                order.reverse()
            logits = [None] * len(sequences)
            for position in order:
                local = megatron_logits(model, sequences[position]).contiguous()
                parts = [torch.empty_like(local) for _ in range(tp_size)]
                dist.all_gather(parts, local, group=group)
                logits[position] = torch.cat(parts, dim=-1).numpy()  # the vocabulary is split over TP ranks
            # numpy, not tensors: torch would send shared-memory handles that die with this process
            exported = {name: tensor.numpy() for name, tensor in export_hf_weights(model, config).items()}
            reports.append((logits, exported))
        results.put((rank, reports if rank == 0 else None, None))
    except BaseException as error:  # report, never hang the parent
        results.put((rank, None, repr(error)))
    finally:
        results.close()
        results.join_thread()
        os._exit(0)  # skip gloo / Megatron teardown in the child


def run_parallel_ranks(runs: list[tuple[str, int]], sequences: list, world_size: int = 2) -> list[tuple[list, dict]]:
    """Spawn `world_size` ranks (`tp_rank_worker`) once for every (checkpoint directory, ep_size) of `runs`
    (TP = world_size / ep_size); rank 0's (full-vocabulary logits per sequence, exported HF weights as numpy
    arrays), one per run in order. A rank's error fails the caller."""
    import multiprocessing

    from trainer.distributed import find_free_port

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = find_free_port()
    runs = [(str(hf_dir), ep_size) for hf_dir, ep_size in runs]
    procs = [context.Process(target=tp_rank_worker, args=(rank, world_size, port, runs, sequences, results))
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    try:
        reports = {}
        for _ in procs:
            rank, report, error = results.get(timeout=120 + 60 * len(runs))
            assert error is None, f"rank {rank}: {error}"
            reports[rank] = report
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return reports[0]


def run_tp_ranks(hf_dir, sequences: list, world_size: int = 2, ep_size: int = 1) -> tuple[list, dict]:
    """`run_parallel_ranks` on one checkpoint: rank 0's (logits per sequence, exported HF weights)."""
    (report,) = run_parallel_ranks([(hf_dir, ep_size)], sequences, world_size)
    return report
