"""Rotary frequencies (float32, one per pair of channels of a head), plain and Llama 3.x-scaled."""

from __future__ import annotations

import math

import torch

from vgbs_ray.models.families.spec import RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """[head_dim / 2] inverse frequencies (radians per token), as Megatron and transformers compute them,
    then stretched per `scaling` (see `RopeScaling`): long wavelengths / factor, short ones kept, a
    linear blend in the band between."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
    context = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    stretched = torch.where(wavelength > context / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
    blend = (context / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - blend) * stretched / scaling.factor + blend * stretched
    in_band = (wavelength >= context / scaling.high_freq_factor) & (wavelength <= context / scaling.low_freq_factor)
    return torch.where(in_band, blended, stretched)
