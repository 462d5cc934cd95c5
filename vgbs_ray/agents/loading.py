"""Agents and prompt sources named by import path: `"my_pkg.agents:make_agent"` plus keyword arguments.

The named object is called with the keyword arguments from the job config and must return the
agent (`async def agent(row, ctx)`); a plain async function named directly is the agent itself
when no keyword arguments are given. The module is imported where the producer runs, so it
travels with `ray job submit --working-dir .` or a runtime env's `py_modules`.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

from vgbs_ray.errors import ConfigError


def resolve(import_path: str, what: str = "rollout.agent") -> Callable:
    """The object named `module.path:attribute` (a dotted attribute path after the colon is allowed)."""
    if not isinstance(import_path, str) or import_path.count(":") != 1:
        raise ConfigError(f"{what}={import_path!r} must be 'module.path:name', e.g. 'my_pkg.agents:make_agent'")
    module_name, attribute = import_path.split(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"{what}={import_path!r}: cannot import {module_name!r} ({error}); ship it with "
                          "`ray job submit --working-dir .` or put it on PYTHONPATH") from error
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{what}={import_path!r}: module {module_name!r} has no {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{what}={import_path!r} is not callable")
    return target


def load_agent(import_path: str, kwargs: dict | None = None, what: str = "rollout.agent") -> Callable:
    """The agent that `import_path` names (see module docstring)."""
    target = resolve(import_path, what)
    if inspect.iscoroutinefunction(target) and not kwargs:
        return target
    agent = target(**(kwargs or {}))
    if not inspect.iscoroutinefunction(agent) and not inspect.iscoroutinefunction(getattr(agent, "__call__", None)):
        raise ConfigError(f"{what}={import_path!r} returned {agent!r}: it must return an async function "
                          "`async def agent(row: dict, ctx: RolloutContext) -> float | AgentResult`")
    return agent
