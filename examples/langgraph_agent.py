"""A LangGraph agent (langchain-openai's ChatOpenAI with a bound tool, in a tool loop), trained unchanged.

    --set rollout.endpoint.enabled=true
    --set rollout.agent=vgbs_ray.agents.openai_agent:make_agent
    --set rollout.prompts=examples.calculator_agent:make_prompts   # rows {a, b}
    --set rollout.agent_kwargs='{run: examples.langgraph_agent:run}'

LangGraph's prebuilt ReAct graph: the model node calls the endpoint with the tool bound, the tool node runs
`add`, and the loop ends when a reply calls no tool. The reward: the last message holds the right sum.
"""

from __future__ import annotations

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.prebuilt import create_react_agent


@tool
def add(a: int, b: int) -> int:
    """Adds two integers."""
    return a + b


async def run(row: dict, base_url: str, api_key: str, max_tokens: int = 64, max_steps: int = 6,
              streaming: bool = False) -> float:
    model = ChatOpenAI(model="policy", base_url=base_url, api_key=api_key, max_tokens=max_tokens, max_retries=0,
                       streaming=streaming)
    graph = create_react_agent(model, [add])
    try:
        question = f"What is {row['a']} + {row['b']}?"
        state = await graph.ainvoke({"messages": [("user", question)]}, {"recursion_limit": max_steps})
    except GraphRecursionError:
        return 0.0  # the policy kept calling: no answer
    return 1.0 if str(row["a"] + row["b"]) in str(state["messages"][-1].content) else 0.0
