"""An OpenAI Agents SDK agent with one tool (`add`), as its author writes it for OpenAI: the SDK's default
model (the Responses API), tracing left on, a model name of its own, the SDK's exceptions uncaught. Nothing
in it names rldock: the SDK's client reads `OPENAI_BASE_URL` and `OPENAI_API_KEY`, which rldock sets for
each episode, and the episode's result goes to the file `RLDOCK_RESULT_FILE` names. It is the user's
program, not rldock's, run as a command in a virtualenv of its own (openai-agents' websockets pin keeps it
out of rldock's lock):

    python3 -m venv ~/.cache/rldock/openai-agents
    ~/.cache/rldock/openai-agents/bin/pip install -r examples/harnesses/openai-agents-requirements.txt

    agent:
      harness_command: [~/.cache/rldock/openai-agents/bin/python, examples/harnesses/openai_agents_sdk_agent.py]
    reward:
      terms: [{name: environment}]

The reward: 1 when the agent's final output is the row's ground truth. The SDK's tracing, which cannot
reach OpenAI from a training cluster, prints its failure to stderr: the episode's log, never its reward.
"""

import asyncio
import json
import os

from agents import Agent, Runner, function_tool


@function_tool
def add(a: int, b: int) -> int:
    """Adds two numbers."""
    return a + b


agent = Agent(name="adder", instructions="Use the tool.", model="gpt-4o-mini", tools=[add])


async def main() -> None:
    with open(os.environ["RLDOCK_TASK_FILE"]) as task_file:
        task = json.load(task_file)
    result = await Runner.run(agent, task["prompt"])
    reward = 1.0 if str(result.final_output).strip() == task["ground_truth"] else 0.0
    with open(os.environ["RLDOCK_RESULT_FILE"], "w") as result_file:
        json.dump({"reward": reward}, result_file)


if __name__ == "__main__":
    asyncio.run(main())
