"""Weight sync over a collective (actors/weight_channel.py, vgbs_ray/weight_buckets.py).

Fast: byte buckets round-trip bit for bit with mixed dtypes and stay under their bound; a channel
of three ranks (threads of this process, gloo) delivers every version to every receiver, then
says it closed. Slow: a real train group and a vLLM engine: the engine synced over the channel
samples exactly what the same engine synced through the object store samples (tokens and
log-probs), different from before the sync; a bfloat16 sync moves half the bytes and samples
close to the float32 one.
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
import torch

from actors.weight_channel import WeightChannel
from vgbs_ray.weight_buckets import pack_bucket, plan_buckets, unpack_bucket


def tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(50, 8, generator=generator), "norm": torch.randn(8, generator=generator),
            "half": torch.randn(300, generator=generator).to(torch.bfloat16), "ids": torch.arange(7),
            "big": torch.randn(40, 40, generator=generator)}


def test_buckets_hold_every_tensor_once_in_order_under_their_bound_and_round_trip_bit_for_bit():
    named = tensors()
    plan = plan_buckets(named, bucket_bytes=1200, policy_version=4)
    slots = [slot for bucket in plan.buckets for slot in bucket.slots]
    assert [slot.name for slot in slots] == list(named) and plan.policy_version == 4
    assert plan.num_bytes == sum(t.numel() * t.element_size() for t in named.values())
    for bucket in plan.buckets:  # within the bound, unless one tensor alone is larger
        assert bucket.num_bytes <= 1200 or len(bucket.slots) == 1
    assert len(plan.buckets) >= 3
    for bucket in plan.buckets:
        for name, tensor in unpack_bucket(pack_bucket(named, bucket), bucket):
            assert tensor.dtype == named[name].dtype and torch.equal(tensor, named[name]), name


def free_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def test_a_channel_delivers_every_version_to_every_receiver_then_says_it_closed():
    address, received = free_address(), {1: [], 2: []}

    def receive(rank):
        channel = WeightChannel(address, rank=rank, world_size=3, timeout_s=60)
        while (version := channel.receive()) is not None:
            received[rank].append(version)

    threads = [threading.Thread(target=receive, args=(rank,)) for rank in (1, 2)]
    for thread in threads:
        thread.start()
    sender = WeightChannel(address, rank=0, world_size=3, timeout_s=60)
    named = tensors()
    sent = [sender.send(named, policy_version=v, bucket_bytes=512) for v in (1, 2)]
    sender.close()
    for thread in threads:
        thread.join(60)
    assert sent == [plan_buckets(named, bucket_bytes=512, policy_version=1).num_bytes] * 2
    for rank in (1, 2):
        assert [version for version, _ in received[rank]] == [1, 2]
        for _, pairs in received[rank]:
            assert [name for name, _ in pairs] == list(named)
            assert all(torch.equal(tensor, named[name]) for name, tensor in pairs)


@pytest.mark.slow  # a train group and a vLLM engine: tens of seconds on 2 cores
def test_an_engine_synced_over_the_channel_samples_what_the_object_store_sync_gives(ray_session, tmp_path):
    import ray

    from trainer.hf_checkpoint import write_hf_checkpoint
    from actors.rollout_engine import EngineConfig, RolloutEnginePool
    from trainer.config import ModelConfig
    from actors.train_group import TrainGroup
    from actors.weight_sync import (WeightSyncConfig, hf_tensors_from_full, open_weight_channel, publish_weights,
                                    send_weights)
    from tests.train_support import sgd_config
    from vgbs_ray.agents import SamplingConfig

    def engine_embedding(engine) -> torch.Tensor:  # nested: Ray pickles it by value into the engine actor
        """Inside the engine actor: its model's input embedding (a copy)."""
        [weight] = engine.llm.collective_rpc(
            lambda worker: worker.model_runner.model.model.embed_tokens.weight.detach().clone())
        return weight

    model = ModelConfig(seed=5)
    prompts, sampling = [[3, 14, 15, 92, 65], list(range(40, 71)), [7] * 9], SamplingConfig(max_tokens=12, seed=3)
    group, engines = TrainGroup(sgd_config(model=model)), None
    try:
        v0 = publish_weights(group, 0)
        model_dir = write_hf_checkpoint(tmp_path / "v0", model, {k: torch.from_numpy(v) for k, v in ray.get(v0.ref).items()})
        engines = RolloutEnginePool(EngineConfig(num_engines=1, max_model_len=model.max_position_embeddings), str(model_dir))
        before = engines.generate(prompts, sampling)
        # New weights in the trainer (what a step would do, without one).
        (full,) = ray.get([actor.full_parameters.remote() for actor in group.actors], timeout=60)
        rng = np.random.default_rng(1)
        moved = {name: array + 0.05 * rng.standard_normal(array.shape).astype(array.dtype) for name, array in full.items()}
        ray.get([actor.load_full_parameters.remote(moved) for actor in group.actors], timeout=60)

        collective = WeightSyncConfig(transport="collective", bucket_mb=0.25, timeout_s=120)
        open_weight_channel(group, engines, collective)
        sent = send_weights(group, 1, collective)
        (load,) = ray.get(engines.weight_loads(1), timeout=120)
        assert load.policy_version == 1 and load.num_bytes == sent.num_bytes == v0.num_bytes
        over_channel = engines.generate(prompts, sampling)

        published = publish_weights(group, 2)  # the same weights through the object store
        engines.wait_for_weights(engines.update_weights(published))
        through_store = engines.generate(prompts, sampling)

        half = WeightSyncConfig(transport="collective", dtype="bfloat16", timeout_s=120)
        sent_half = send_weights(group, 3, half)
        (load_half,) = ray.get(engines.weight_loads(3), timeout=120)
        in_bfloat16 = engines.generate(prompts, sampling)
        embedding_in_bfloat16 = ray.get(engines.engines[0].__ray_call__.remote(engine_embedding), timeout=60)
    finally:
        if engines is not None:
            engines.shutdown()
        group.shutdown()

    assert [g.policy_version for g in over_channel] == [1] * 3 and [g.policy_version for g in in_bfloat16] == [3] * 3
    for a, b, old in zip(over_channel, through_store, before):
        assert np.array_equal(a.response_token_ids, b.response_token_ids)
        np.testing.assert_allclose(a.response_log_probs, b.response_log_probs, atol=1e-6)
        assert not np.allclose(a.response_log_probs, old.response_log_probs, atol=1e-3)  # the sync changed them
    assert sent_half.num_bytes * 2 == sent.num_bytes and load_half.num_bytes == sent_half.num_bytes
    # The engine holds the trainer's weights rounded to bfloat16, exactly.
    expected = hf_tensors_from_full(moved, model)["model.embed_tokens.weight"].to(torch.bfloat16).float()
    assert torch.equal(embedding_in_bfloat16, expected)
    assert not torch.equal(expected, hf_tensors_from_full(moved, model)["model.embed_tokens.weight"])


RECEIVER = """
import sys, time
from actors.weight_channel import WeightChannel
channel = WeightChannel(sys.argv[1], rank=2, world_size=3, timeout_s=60)
print(channel.receive()[0], flush=True)
time.sleep(600)
"""


def test_a_send_to_a_dead_engine_is_a_channel_error_and_no_receiver_gets_part_of_a_version():
    """Receiver 2 (a process of its own) dies after version 1: sending version 2 raises WeightChannelError (the
    engine's failure, which the job answers by replacing the engine, not the train group), and receiver 1 either
    gets all of version 2 or an error, never a part of it."""
    import subprocess
    import sys

    from actors.weight_sync import WeightChannelError

    address, received = free_address(), []

    def receive():
        channel = WeightChannel(address, rank=1, world_size=3, timeout_s=20)
        try:
            while (version := channel.receive()) is not None:
                received.append(version)
        except RuntimeError:  # the channel broke under it: an engine's receiver reports it (_channel_failed)
            pass

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    engine = subprocess.Popen([sys.executable, "-c", RECEIVER, address], stdout=subprocess.PIPE, text=True)
    try:
        sender = WeightChannel(address, rank=0, world_size=3, timeout_s=20)
        named = tensors()
        sender.send(named, policy_version=1, bucket_bytes=512)
        assert engine.stdout.readline().strip() == "1"  # it holds version 1, then dies
        engine.kill()
        engine.wait(30)
        started = time.monotonic()
        with pytest.raises(WeightChannelError, match="policy version 2 could not be sent"):
            sender.send(named, policy_version=2, bucket_bytes=512)
        assert time.monotonic() - started < 10  # at once, not after the channel's timeout
    finally:
        engine.kill()
    # Receiver 1 gets nothing of version 2: `receive` returns a version only once all its buckets came.
    assert [version for version, _ in received] == [1]
    assert all(torch.equal(tensor, named[name]) for name, tensor in received[0][1])
