"""Policy losses: the API a loss is written against, the built-ins, aggregations and corrections.

    from vgbs_ray.losses import LossInputs, LossOutput, PolicyLoss

docs/losses.md has each built-in's formula and how to write one.
"""

from vgbs_ray.losses.api import AGGREGATIONS, LossInputs, LossOutput, PolicyLoss
from vgbs_ray.losses.config import BUILTIN_LOSSES, CorrectionConfig

__all__ = ["AGGREGATIONS", "BUILTIN_LOSSES", "CorrectionConfig", "LossInputs", "LossOutput", "PolicyLoss"]
