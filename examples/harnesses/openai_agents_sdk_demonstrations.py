"""Demonstrations for examples/harnesses/openai_agents_sdk_agent.py's task: each addition row ("85+63=", answer
"148") gets a `demonstration` column, the turns after the prompt the agent's episode should have: the model's
call of the agent's `add` tool (the Hermes format the gateway parses, agent.tool_call_format), the tool's
output as the SDK sends it back ("148"), and the model's answer. The warm-up trains on the model's turns, after
each row's prompt rendered as the gateway renders the SDK's requests (agent.harness_request).

    python examples/harnesses/openai_agents_sdk_demonstrations.py ~/.cache/rldock/data/addition/train.jsonl
"""

import json
import sys
from pathlib import Path


def demonstration(prompt: str, answer: str) -> list[dict]:
    a, b = prompt.rstrip("=").split("+")
    call = json.dumps({"name": "add", "arguments": {"a": int(a), "b": int(b)}})
    return [
        {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
        {"role": "tool", "content": str(int(a) + int(b))},
        {"role": "assistant", "content": answer},
    ]


def main(path: Path) -> None:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    lines = [json.dumps({**row, "demonstration": demonstration(row["prompt"], str(row["answer"]))}) for row in rows]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]).expanduser())
