"""The policy model: a Megatron-Core GPTModel of one model family, built from a frozen config.

RMSNorm, SwiGLU MLP (`linear_fc1` holds [gate; up]), rotary position embeddings, grouped-query
attention, no output-projection or MLP biases; per family (`vgbs_ray.models.families`) QKV
biases (Qwen2) or per-head QK RMSNorm (Qwen3); tied or untied embeddings, a head width of its own
(`kv_channels`) and Llama 3.x RoPE scaling per checkpoint. `vgbs_ray.models.hf_mapping` maps the layout
one-to-one onto the family's Hugging Face `*ForCausalLM`.

Attention. Micro-batches are THD packed sequences; Megatron's local `DotProductAttention`
rejects packed sequences (and allocates on CUDA), so:
- GPU with Transformer Engine installed: Megatron's TE layer spec and its own attention.
- otherwise (CPU, or GPU without TE): the local spec with `core_attention` swapped for
  `SDPAAttention` below (scaled_dot_product_attention, causal within each packed sequence
  as `cu_seqlens` delimits it: a token never sees another sequence).
RoPE: with THD packing, positions restart at every sequence only because callers pass the
longest sequence as `max_seqlen` (`packed_seq_params`); Megatron's rotary embedding asks for a
CUDA device on CPU, which `megatron_cpu_compat.make_rotary_embedding_cpu_safe` removes.
On CPU every fusion is off. With `use_cpu_initialization` the full weights are drawn from torch's generator and
then split, so a TP=2 model starts from exactly the TP=1 weights for the same seed.

Must be called after `parallel_state.initialize_model_parallel`.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from trainer.hf_checkpoint import load_hf_weights, model_config_from_hf, read_hf_weights
from trainer.megatron_cpu_compat import activate as activate_cpu_compat
from trainer.megatron_cpu_compat import make_rotary_embedding_cpu_safe
from trainer.config import ModelConfig
from vgbs_ray.errors import ConfigError
from vgbs_ray.models.families import get_family
from vgbs_ray.models.families.rope import rope_inv_freq


class SDPAAttention(MegatronModule):
    """Core attention on `F.scaled_dot_product_attention`, for CPU.

    Inputs are [s, b, heads, dim] (sbhd, causal) or, with THD packed sequences,
    [t, heads, dim] and `packed_seq_params.cu_seqlens_q` (causal within each sequence, i.e.
    a block-diagonal causal mask); outputs [s, b, heads * dim] and [t, heads * dim].
    Grouped-query keys and values are repeated to the query heads.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ConfigError("SDPAAttention (the CPU attention) does not support context parallelism: set cp_size=1")
        self.softmax_scale = softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params: PackedSeqParams | None = None):
        dropout_p = self.dropout_p if self.training else 0.0
        if query.shape[-2] != key.shape[-2]:
            repeat = query.shape[-2] // key.shape[-2]
            key = key.repeat_interleave(repeat, dim=-2)
            value = value.repeat_interleave(repeat, dim=-2)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            # One causal attention per packed sequence: the cost is sum(L_i^2) like varlen flash
            # attention on GPU, not T^2 of the whole row (which a block-diagonal mask would cost).
            bounds = packed_seq_params.cu_seqlens_q.tolist()
            if bounds[-1] != query.shape[0]:
                raise ValueError(f"cu_seqlens covers {bounds[-1]} tokens but the micro-batch has {query.shape[0]}")
            outputs = []
            for start, end in zip(bounds[:-1], bounds[1:]):
                q, k, v = (x[start:end].transpose(0, 1) for x in (query, key, value))  # [h, L, d]
                outputs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p,
                                                              scale=self.softmax_scale).transpose(0, 1))
            return torch.cat(outputs, dim=0).reshape(query.shape[0], -1)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, h, s, d]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p,
                                             scale=self.softmax_scale)
        seq, batch = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)


def transformer_config(config: ModelConfig, *, tp_size: int, pp_size: int, cp_size: int,
                       on_gpu: bool, vpp_size: int = 1, ep_size: int = 1,
                       microbatch_group_size_per_vp_stage: int | None = None) -> TransformerConfig:
    """The Megatron TransformerConfig for `config` under the given parallel sizes."""
    dtype = torch.bfloat16 if config.params_dtype == "bfloat16" else torch.float32
    family = get_family(config.family)
    return TransformerConfig(
        **_pipeline_settings(pp_size, vpp_size, microbatch_group_size_per_vp_stage, dtype),
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_query_groups,
        kv_channels=config.head_dim,
        ffn_hidden_size=config.ffn_hidden_size,
        # Every family: RMSNorm, SwiGLU (silu-gated fc1 = [gate; up]), no output-projection or MLP biases.
        normalization="RMSNorm",
        layernorm_epsilon=config.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=family.qkv_bias,
        qk_layernorm=family.qk_norm,
        **_moe_settings(config, ep_size),
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        context_parallel_size=cp_size,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=not on_gpu,
        # The fusions need CUDA kernels; on GPU they are left to Megatron's defaults.
        **({} if on_gpu else dict(
            gradient_accumulation_fusion=False,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            masked_softmax_fusion=False,
            apply_rope_fusion=False,
            persist_layer_norm=False,
        )),
    )


def _moe_settings(config: ModelConfig, ep_size: int = 1) -> dict:
    """TransformerConfig fields of a mixture of experts (none for a dense model).

    Softmax over the top-k router logits equals HF's softmax-then-top-k renormalised
    (`norm_topk_prob`); without renormalisation the softmax comes first (`moe_router_pre_softmax`).
    SequentialMLP experts. The allgather dispatcher needs the same token count on every rank it gathers
    from, true of TP peers (one micro-batch) but not of EP peers (each DP rank packs its own rows): with
    expert parallelism the alltoall dispatcher, which exchanges split sizes first (on CPU through
    trainer/megatron_cpu_compat.py). No load-balancing loss: the policy loss is the only objective here
    (HF adds one only when asked to output router logits).
    """
    if config.num_experts is None:
        return {}
    return dict(num_moe_experts=config.num_experts, moe_ffn_hidden_size=config.moe_ffn_hidden_size,
                moe_router_topk=config.moe_router_topk, moe_router_pre_softmax=not config.moe_norm_topk_prob,
                moe_token_dispatcher_type="allgather" if ep_size == 1 else "alltoall", moe_grouped_gemm=False,
                expert_model_parallel_size=ep_size,
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)


def _pipeline_settings(pp_size: int, vpp_size: int, group: int | None, dtype: torch.dtype) -> dict:
    """TransformerConfig fields of Megatron's pipeline schedule (Megatron's own schedule).

    Micro-batches are packed rows of different lengths: stages exchange shapes first
    (`variable_seq_lengths`, which Megatron accepts only with the alltoall dispatcher). Batched
    p2p under VPP swaps messages silently when previous and next rank are one process (PP=2):
    overlapped, unbatched p2p instead.
    """
    if pp_size == 1:
        return {}
    return dict(pipeline_dtype=dtype, variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",
                batch_p2p_comm=False, overlap_p2p_comm=vpp_size > 1,
                virtual_pipeline_model_parallel_size=vpp_size if vpp_size > 1 else None,
                microbatch_group_size_per_vp_stage=group)


def build_gpt_model(config: ModelConfig, *, tp_size: int = 1, pp_size: int = 1, cp_size: int = 1,
                    on_gpu: bool = False, pre_process: bool = True, post_process: bool = True,
                    vpp_size: int = 1, vp_stage: int | None = None, ep_size: int = 1,
                    microbatch_group_size_per_vp_stage: int | None = None, local_spec: bool = False) -> GPTModel:
    """Build the GPTModel (with pp_size > 1: this stage's chunk `vp_stage`); deterministic for a given `config.seed`.
    `local_spec`: Megatron's local layers even where Transformer Engine is installed (LoRA: TE fuses the norm
    into `linear_qkv` and `linear_fc1`, whose inputs the adapters must see normalised; trainer/lora_layers.py)."""
    torch.manual_seed(config.seed)
    qk_norm = get_family(config.family).qk_norm
    if on_gpu and transformer_engine_available() and not local_spec:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=config.num_experts, moe_grouped_gemm=False,
                                                          qk_layernorm=qk_norm)
    else:
        spec = copy.deepcopy(get_gpt_layer_local_spec(num_experts=config.num_experts, moe_grouped_gemm=False,
                                                      normalization="RMSNorm", qk_layernorm=qk_norm))
        if config.num_experts is not None and not on_gpu:
            activate_cpu_compat()  # the router moves its weight to CUDA, and MoE utilities assume TE
        spec.submodules.self_attention.submodules.core_attention = SDPAAttention
    model = GPTModel(
        config=transformer_config(config, tp_size=tp_size, pp_size=pp_size, cp_size=cp_size, on_gpu=on_gpu,
                                  vpp_size=vpp_size, ep_size=ep_size,
                                  microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage),
        transformer_layer_spec=spec,
        vocab_size=config.vocab_size,
        max_sequence_length=config.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=config.tie_word_embeddings,
        vp_stage=vp_stage,
        position_embedding_type="rope",
        rotary_base=config.rope_theta,  # GPTModel reads the base from this argument, not from the config
    )
    if config.rope_scaling is not None:
        _scale_rotary_frequencies(model, config)
    if config.hf_checkpoint_dir is not None:
        _load_initial_weights(model, config)
    if on_gpu:
        return model.cuda()
    make_rotary_embedding_cpu_safe(model)
    return model


def _scale_rotary_frequencies(model: GPTModel, config: ModelConfig) -> None:
    """Llama 3.x RoPE scaling with the checkpoint's own parameters: Megatron's `rope_scaling` hard-codes
    low/high frequency factors 1 / 4 and an 8192-token original context, so the frequencies are set here."""
    inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.inv_freq = inv_freq.to(module.inv_freq.device)


def _load_initial_weights(model: GPTModel, config: ModelConfig) -> None:
    """Weights from `config.hf_checkpoint_dir`, whose config.json must describe the same model."""
    from dataclasses import fields

    path = config.hf_checkpoint_dir
    expected = model_config_from_hf(path, seed=config.seed, params_dtype=config.params_dtype, hf_checkpoint_dir=path)
    differ = [f"{f.name}={getattr(config, f.name)!r} (checkpoint: {getattr(expected, f.name)!r})"
              for f in fields(config) if getattr(config, f.name) != getattr(expected, f.name)]
    if differ:
        raise ConfigError(f"ModelConfig does not match {path}/config.json: {', '.join(differ)}; build the "
                          "config with trainer.hf_checkpoint.model_config_from_hf")
    load_hf_weights(model, read_hf_weights(path), config)


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def packed_seq_params(cu_seqlens: torch.Tensor, max_seqlen: int) -> PackedSeqParams:
    """THD packed-sequence parameters for one micro-batch row."""
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)
