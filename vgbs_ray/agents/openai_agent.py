"""Agents written against the OpenAI client, trained through the job's endpoint.

    # my_agents/solver.py: ordinary OpenAI-client code; only base_url and api_key come from the job
    from openai import OpenAI

    def run(row: dict, base_url: str, api_key: str) -> float:
        client = OpenAI(base_url=base_url, api_key=api_key)
        reply = client.chat.completions.create(model="policy", messages=[...], max_tokens=64)
        return 1.0 if row["answer"] in reply.choices[0].message.content else 0.0

    --set rollout.endpoint.enabled=true
    --set rollout.agent=vgbs_ray.agents.openai_agent:make_agent
    --set rollout.agent_kwargs='{run: my_agents.solver:run}'

`run(row, base_url, api_key, **run_kwargs)` may be sync (it runs in a daemon thread, so blocking
clients work, and a `run` that never returns, lost as `agent_timeout`, cannot hold the producer's
process at exit) or async. It returns the rollout's reward (a float or an `AgentResult`), or None
after reporting the reward itself with `report_reward` (or `POST {reward_url}` from any process
or language). The rollout ends, and its samples are pushed, when the reward is known: returned
or reported, whichever comes first. `base_url` names the rollout's session, so everything sent
to it belongs to this rollout (see vgbs_ray/agents/openai_protocol.py for what is trained).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import threading
import urllib.request
import weakref

from vgbs_ray.agents.generation import RequestTooLongError
from vgbs_ray.agents.loading import resolve
from vgbs_ray.agents.rollout import AgentResult
from vgbs_ray.errors import ConfigError


def reward_url(base_url: str) -> str:
    """The reward report's URL for a session's base_url (`.../sessions/{session}/v1` -> `.../reward`)."""
    return base_url.rstrip("/").removesuffix("/v1") + "/reward"


def report_reward(base_url: str, api_key: str, reward: float, metrics: dict | None = None, timeout_s: float = 30):
    """Report a rollout's reward to its session (blocking, standard library only)."""
    request = urllib.request.Request(
        reward_url(base_url), method="POST", data=json.dumps({"reward": reward, "metrics": metrics or {}}).encode(),
        headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:
        return json.loads(answer.read())


_async_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""One `openai.AsyncOpenAI` per event loop (its connections belong to that loop)."""


def async_openai_client(base_url: str, api_key: str):
    """An `openai.AsyncOpenAI` for one rollout's session (call it inside the rollout's event loop), over one HTTP
    client per loop. A new `AsyncOpenAI` per rollout builds a new SSL context (CA certificates loaded) each time:
    measured, half of a producer's CPU at 128 rollouts a step (docs/agents.md); `with_options` gives a client with
    the session's URL and key over the same connections."""
    from openai import AsyncOpenAI

    loop = asyncio.get_running_loop()
    if loop not in _async_clients:
        _async_clients[loop] = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    return _async_clients[loop].with_options(base_url=base_url, api_key=api_key)


def in_daemon_thread(function) -> asyncio.Future:
    """`function()` in a new daemon thread, as a future of this loop. Not a ThreadPoolExecutor: its workers are
    joined at interpreter exit, so one `run` that never returns would keep the producer's process alive forever."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(outcome, error) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(outcome)

    def call() -> None:
        try:
            outcome, error = function(), None
        except BaseException as raised:  # noqa: BLE001 - handed to the awaiting agent as its own error
            outcome, error = None, raised
        if not loop.is_closed():
            loop.call_soon_threadsafe(settle, outcome, error)

    threading.Thread(target=call, name="agent-run", daemon=True).start()
    return future


def make_agent(run: str, run_kwargs: dict | None = None, threads: int = 256):
    """The agent running `run` (an import path, see module docstring) for each rollout; at most `threads` sync
    `run`s at once (at least groups_in_flight x group_size, so no rollout waits for one)."""
    target = resolve(run, "rollout.agent_kwargs.run")
    kwargs = dict(run_kwargs or {})
    slots = asyncio.Semaphore(threads)

    async def in_thread(*args):
        async with slots:
            return await in_daemon_thread(functools.partial(target, *args, **kwargs))

    async def agent(row: dict, ctx) -> AgentResult:
        if ctx.endpoint is None:
            raise ConfigError("vgbs_ray.agents.openai_agent needs the job's endpoint: set "
                              "rollout.endpoint.enabled=true")
        session = ctx.endpoint
        if inspect.iscoroutinefunction(target):
            called = target(row, session.base_url, session.api_key, **kwargs)
        else:
            called = in_thread(row, session.base_url, session.api_key)
        running = asyncio.ensure_future(called)
        reported = asyncio.ensure_future(session.rollout.result())
        try:
            await asyncio.wait([running, reported], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (running, reported):
                if not task.done():
                    task.cancel()  # a sync run's thread goes on; its later requests get 404 (session ended)
        rollout = session.rollout
        if rollout.fatal_error is not None:
            raise rollout.fatal_error  # the engines failed: the producer's error, not the agent's
        if rollout.failure is not None:
            raise RequestTooLongError(rollout.failure[1])  # lost as too_long, like a Python agent's rollout
        if rollout.reported:
            return await rollout.result()
        returned = running.result()  # the agent's own exception, if it raised
        if returned is None:
            raise RuntimeError(f"{run} returned None and reported no reward (return it, or POST it to "
                               f"{session.reward_url})")
        return returned

    return agent
