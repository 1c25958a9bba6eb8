"""A LangGraph ReAct agent with one tool (`add`), as its authors would write it for any OpenAI endpoint: the
only change for rldock is the model's `base_url` and `api_key`, read from the client the gateway hands over.
It is the user's program, not rldock's: a job names it by its path (relative to where `rldock train` runs).

    agent:
      harness: examples/harnesses/langgraph_agent.py:run
    reward:
      terms: [{name: environment}]

The reward: 1 when the agent's last message ends with the row's ground truth. LangGraph and langchain-openai
are in the lock's test section (not in the runtime image): install them where the harness runs.
(`create_react_agent` is LangGraph 1.x's; its successor, `langchain.agents.create_agent`, needs the
`langchain` package, which the lock does not have.)
"""

from __future__ import annotations


def add(a: float, b: float) -> float:
    """Adds two numbers."""
    return a + b


async def run(task, client):
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    model = ChatOpenAI(model="policy", base_url=str(client.base_url), api_key=client.api_key, max_retries=0)
    agent = create_react_agent(model, [add])
    prompt = task["prompt"]
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    state = await agent.ainvoke({"messages": messages}, {"recursion_limit": 8})
    answer = str(state["messages"][-1].content).strip()
    return float(answer.endswith(str(task["ground_truth"])))
