"""`trainer.megatron_cpu_compat.activate`: Megatron's CUDA literals redirected on CPU, nothing else.

The schedule, DDP and optimizer running on them are covered by test_train_step.py and the
pipeline tests; here the redirect itself: where it applies, where it must not, and that the
replaced grad-norm and clipping functions compute what Megatron's do.
"""

from __future__ import annotations

import pytest
import torch

from tests.train_support import ensure_single_process_group

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the redirect is inactive when CUDA is present")


def test_patched_modules_allocate_cuda_literals_on_cpu_and_torch_itself_is_untouched():
    from trainer.megatron_cpu_compat import activate

    assert activate() is True
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    assert schedules.torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert p2p_communication.torch.empty((3,), device=p2p_communication.torch.cuda.current_device()).device.type == "cpu"
    assert param_and_grad_buffer.torch.zeros(4, device=torch.device("cuda", 0)).device.type == "cpu"
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import moe_utils, router

    assert router.torch.cuda.current_device() == torch.device("cpu")  # the MoE router's weight move
    assert mappings.get_global_memory_buffer().get_tensor((2, 3), torch.float32, "mpu").device.type == "cpu"
    assert moe_utils.te_general_gemm is None  # the router's gating takes its torch.mm branch without TE
    from megatron.core.transformer.moe import token_dispatcher

    stream = token_dispatcher.torch.cuda.Stream()  # the alltoall dispatcher's device-to-host stream
    assert token_dispatcher.torch.cuda.current_stream() == stream
    with token_dispatcher.torch.cuda.stream(stream):
        stream.wait_stream(stream)
    stream.record_event().synchronize()
    splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
    assert splits.tolist() == [3, 1] and not torch.is_tensor(splits)  # what all_to_all_single takes
    assert token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([2])).tolist() == [2]
    assert schedules.torch.Tensor is torch.Tensor  # everything else is the real torch
    with pytest.raises((AssertionError, RuntimeError)):  # the real torch still has no CUDA
        torch.zeros(1, device="cuda")
    import megatron.core.utils as megatron_utils

    assert megatron_utils.torch is torch  # modules outside the list are not touched


def test_grad_norm_and_clipping_match_plain_torch():
    ensure_single_process_group()
    from trainer.megatron_cpu_compat import activate

    activate()
    from megatron.core import parallel_state
    from megatron.core.optimizer import clip_grads

    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in ((3, 4), (5,), (2, 2, 2))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)
    expected = float(torch.cat([p.grad.reshape(-1) for p in params]).norm())
    norm = clip_grads.get_grad_norm_fp32([p.grad for p in params],
                                         grad_stats_parallel_group=parallel_state.get_model_parallel_group())
    assert norm == pytest.approx(expected, rel=1e-6)
    before = [p.grad.clone() for p in params]
    clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=expected / 4, total_norm=norm)
    for p, g in zip(params, before):
        torch.testing.assert_close(p.grad, g * (expected / 4) / (norm + 1e-6))
    clipped = [p.grad.clone() for p in params]
    clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=10 * expected, total_norm=norm)  # below the max: no-op
    assert all(torch.equal(p.grad, g) for p, g in zip(params, clipped))


def test_inactive_when_cuda_is_present(monkeypatch):
    from trainer import megatron_cpu_compat

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert megatron_cpu_compat.activate() is False
