"""An OpenAI Agents SDK agent with a function tool, trained unchanged through the job's endpoint.

    --set rollout.endpoint.enabled=true
    --set rollout.agent=vgbs_ray.agents.openai_agent:make_agent
    --set rollout.prompts=examples.calculator_agent:make_prompts   # rows {a, b}
    --set rollout.agent_kwargs='{run: examples.agents_sdk_agent:run}'

Ordinary Agents SDK code: an `Agent` with a `@function_tool`, run by `Runner.run` over chat completions, or over
the Responses API (`api="responses"`: the SDK's default model, `OpenAIResponsesModel`), streamed or not; only the
client's base_url and api_key come from the job. The reward: the final answer holds the right sum.
"""

from __future__ import annotations

from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, RunConfig, Runner,
                    function_tool)
from agents.exceptions import MaxTurnsExceeded

from vgbs_ray.agents.openai_agent import async_openai_client


@function_tool
def add(a: int, b: int) -> int:
    """Adds two integers."""
    return a + b


async def run(row: dict, base_url: str, api_key: str, max_tokens: int = 64, max_turns: int = 3,
              streaming: bool = False, api: str = "chat") -> float:
    client = async_openai_client(base_url, api_key)  # an AsyncOpenAI; one per rollout would cost an SSL context each
    model = (OpenAIResponsesModel(model="policy", openai_client=client) if api == "responses"
             else OpenAIChatCompletionsModel(model="policy", openai_client=client))
    agent = Agent(name="adder", instructions="Answer with the sum. Use the add tool.", tools=[add], model=model,
                  model_settings=ModelSettings(max_tokens=max_tokens))
    question, config = f"What is {row['a']} + {row['b']}?", RunConfig(tracing_disabled=True)
    try:
        if streaming:  # the SDK's streamed run: server-sent events from the endpoint
            result = Runner.run_streamed(agent, question, max_turns=max_turns, run_config=config)
            async for _ in result.stream_events():
                pass
        else:
            result = await Runner.run(agent, question, max_turns=max_turns, run_config=config)
    except MaxTurnsExceeded:
        return 0.0  # the policy kept calling: no answer
    return 1.0 if str(row["a"] + row["b"]) in str(result.final_output) else 0.0
