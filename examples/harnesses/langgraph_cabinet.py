"""A LangGraph agent for the cabinet task (examples/agent-smollm2-cabinet.yaml's task, without rldock's loop):
a two-node graph, the model and a shell over the task's files, as its author would write it for any OpenAI
endpoint. The only change for rldock is the model's `base_url` and `api_key`, read from the client the
gateway hands over.

The model runs one command per turn (`ls`, `cat <file>`) and ends with `#### <code>`; the shell answers as a
user message, as the cabinet environment does, so the warm-up's demonstrations show the model exactly what
this graph shows it. The files are the task's own, rebuilt from the row's `extra_info`
(rldock.runtime.agent.examples.cabinet, whose `run` is the shell). The reward: 1 for the right code.

    agent:
      harness: examples/harnesses/langgraph_cabinet.py:run
    reward:
      terms: [{name: environment}]

`python -m rldock_benchmarks.cabinet_learning --arms langgraph,langgraph_learning_rate_0` trains with it
against a learning-rate-0 control (docs/results.md). LangGraph and langchain-openai are in the lock's test
section (not in the runtime image): install them where the harness runs.
"""

# No `from __future__ import annotations`: LangGraph reads the nodes' annotations (MessagesState, imported
# in `run`) at run time.
MAX_TURNS = 4  # ls, cat, the answer, and one to spare (the example's agent.max_turns)


async def run(task, client):
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, MessagesState, StateGraph

    from rldock.runtime.agent.examples.cabinet import build_cabinet, given_answer, task_of
    from rldock.runtime.agent.examples.cabinet import run as shell

    cabinet = build_cabinet(**task_of(task["extra_info"]))
    model = ChatOpenAI(model="policy", base_url=str(client.base_url), api_key=client.api_key, max_retries=0)

    async def think(state: MessagesState) -> dict:
        return {"messages": [await model.ainvoke(state["messages"])]}

    def act(state: MessagesState) -> dict:
        observation = shell(cabinet, str(state["messages"][-1].content).strip())
        return {"messages": [HumanMessage(observation.message or "")]}

    def next_step(state: MessagesState) -> str:
        replies = [m for m in state["messages"] if isinstance(m, AIMessage)]
        last = replies[-1]
        answered = given_answer(str(last.content)) is not None
        cut = (last.response_metadata or {}).get("finish_reason") == "length"
        return END if answered or cut or len(replies) >= MAX_TURNS else "act"

    graph = StateGraph(MessagesState)
    graph.add_node("think", think)
    graph.add_node("act", act)
    graph.add_edge(START, "think")
    graph.add_conditional_edges("think", next_step, ["act", END])
    graph.add_edge("act", "think")
    agent = graph.compile()

    prompt = task["prompt"]
    messages = prompt if isinstance(prompt, list) else [HumanMessage(prompt)]
    state = await agent.ainvoke({"messages": messages}, {"recursion_limit": 2 * MAX_TURNS + 2})
    return float(given_answer(str(state["messages"][-1].content)) == str(task["ground_truth"]))
