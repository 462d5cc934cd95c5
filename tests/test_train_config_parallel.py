"""TrainGroupConfig's parallel fields: what the scheduler is told, and the refusals with their fixes."""

from __future__ import annotations

import pytest

from trainer.config import ModelConfig, TrainGroupConfig
from vgbs_ray.config import ParallelConfig
from vgbs_ray.errors import ConfigError


def test_interleaved_pipeline_advertises_its_micro_batch_group():
    config = TrainGroupConfig(dp_size=2, pp_size=2, vpp_size=2, model=ModelConfig(num_layers=4))
    assert config.world_size == 4
    assert config.parallel_config == ParallelConfig(dp_size=2, vpp_size=2, microbatch_group_size_per_vp_stage=2)
    assert config.parallel_config.microbatch_alignment == 4
    wide = TrainGroupConfig(pp_size=2, vpp_size=2, microbatch_group_size_per_vp_stage=3, model=ModelConfig(num_layers=4))
    assert wide.parallel_config.microbatch_group_size_per_vp_stage == 3
    # without virtual stages, 1F1B needs no alignment beyond dp
    assert TrainGroupConfig(pp_size=2).parallel_config == ParallelConfig(dp_size=1)


@pytest.mark.parametrize("fields, message", [
    (dict(vpp_size=2), "vpp_size=2 needs pp_size > 1"),
    (dict(pp_size=2, vpp_size=2), r"num_layers=2 must be divisible by pp_size \* vpp_size = 4"),
    (dict(pp_size=4), r"num_layers=2 must be divisible by pp_size \* vpp_size = 4"),
    (dict(pp_size=2, vpp_size=2, microbatch_group_size_per_vp_stage=1, model=ModelConfig(num_layers=4)),
     "microbatch_group_size_per_vp_stage=1 must be an integer >= pp_size=2"),
    (dict(cp_size=2), "cp_size=2 needs backend='nccl'.*on CPU set cp_size=1"),
    (dict(vpp_size=0), "vpp_size must be a positive integer"),
])
def test_refusals_name_the_field_and_the_fix(fields, message):
    with pytest.raises(ConfigError, match=message):
        TrainGroupConfig(**fields)


def test_context_parallelism_is_passed_through_on_gpu():
    config = TrainGroupConfig(cp_size=2, backend="nccl")
    assert config.world_size == 2 and config.parallel_config.cp_size == 2
