"""FLOPs of one training sequence through a dense GQA transformer.

Tokens are not compute: attention is quadratic in sequence length, so two micro-batches
with equal token counts can differ several-fold in time when one holds a long sequence.
`TransformerFlopsModel.sequence_flops(length)` gives forward+backward FLOPs for one
sequence of `length` tokens; only ratios matter to the balancer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vgbs_ray.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class TransformerFlopsModel:
    """Dimensions of a dense decoder-only transformer with grouped-query attention.

    Counted per layer: QKV projection, causal attention (scores and weighted sum, half of
    the full square), output projection, MLP (gated or not); then the LM head. The
    embedding lookup costs no multiply-adds. Backward is taken as twice the forward.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int | None = None
    """Key/value heads (GQA); None means multi-head attention (= num_attention_heads)."""
    ffn_hidden_size: int | None = None
    """MLP width; None means 4 * hidden_size."""
    gated_mlp: bool = False
    """SwiGLU-style MLP with three projections instead of two."""
    vocab_size: int = 32000

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"TransformerFlopsModel.{name} must be > 0, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                "TransformerFlopsModel.hidden_size must be divisible by num_attention_heads "
                f"({self.hidden_size} % {self.num_attention_heads} != 0)"
            )
        groups = self.query_groups
        if groups <= 0 or self.num_attention_heads % groups:
            raise ConfigError(
                "TransformerFlopsModel.num_query_groups must divide num_attention_heads "
                f"(got {groups} groups for {self.num_attention_heads} heads)"
            )

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    def sequence_flops(self, lengths) -> np.ndarray:
        """Forward+backward FLOPs for each sequence length in `lengths` (tokens); float64."""
        length = np.asarray(lengths, dtype=np.float64)
        h = self.hidden_size
        head_dim = h // self.num_attention_heads
        kv_width = 2 * self.query_groups * head_dim
        ffn = self.ffn_hidden_size or 4 * h
        mlp_projections = 3 if self.gated_mlp else 2
        linear_per_token = (
            2 * h * (h + kv_width)  # QKV projection
            + 2 * h * h  # attention output projection
            + 2 * h * ffn * mlp_projections  # MLP
        )
        # Causal attention: QK^T and AV each 2*L*L*h multiply-adds, halved by the mask.
        attention = 2 * h * length * length
        forward = self.num_layers * (linear_per_token * length + attention) + 2 * h * self.vocab_size * length
        return 3.0 * forward
