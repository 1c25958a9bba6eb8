"""A user's harness for the gateway's tests: a plain loop over `openai.AsyncOpenAI`, its behaviour chosen
by the task's `mode`; what it saw is written to the task's `out` file for the test to read."""

from __future__ import annotations

import asyncio
import json

import httpx

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Adds two numbers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
        },
    }
]


async def run(task, client):
    mode = task["mode"]
    seen: list = []
    messages = [{"role": "user", "content": task["prompt"]}]
    try:
        if mode == "raise":
            raise RuntimeError("the harness broke")
        if mode == "hang":
            await asyncio.Event().wait()
        if mode == "silent":
            return 0.5
        if mode == "bad_reward":
            await client.chat.completions.create(model="policy", messages=messages)
            return "great"
        if mode == "completions":  # token ids in, token ids out
            answer = await client.completions.create(model="policy", prompt=[1, 5, 6])
            seen.append(answer.choices[0].text)
            return 1.0
        if mode == "compact":  # a turn; the context compacted to a summary, two turns; compacted again, a turn
            answer = None
            for turns in (1, 2, 1):
                summary = "" if answer is None else f" Earlier: {answer}"
                messages = [{"role": "user", "content": task["prompt"] + summary}]
                for turn in range(turns):
                    if turn:
                        messages.append({"role": "user", "content": "Sure?"})
                    response = await client.chat.completions.create(model="policy", messages=messages)
                    answer = response.choices[0].message.content
                    seen.append(answer)
                    messages.append(response.choices[0].message.model_dump(exclude_none=True))
            return 1.0
        if mode == "stream":
            stream = await client.chat.completions.create(model="policy", messages=messages, stream=True)
            text = ""
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
            seen.append(text)
            return {"reward": 1.0, "text": text}
        if mode == "responses_stream":  # the Responses API's events: the text's deltas, then the whole response
            stream = await client.responses.create(model="policy", input=task["prompt"], stream=True)
            text, final = "", None
            async for event in stream:
                if event.type == "response.output_text.delta":
                    text += event.delta
                elif event.type == "response.completed":
                    final = event.response.output_text
            seen.append([text, final])
            return 1.0
        if mode.startswith("responses"):  # the Responses API, as the OpenAI Agents SDK's default model calls it
            return await _responses(task, client, seen, chained=mode == "responses_chained")
        # "tools": call the model, run the tool it asked for, post a step reward, answer
        for _ in range(4):
            response = await client.chat.completions.create(
                model="policy", messages=messages, tools=TOOLS, logprobs=True
            )
            seen.append(response.model_dump())
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                arguments = json.loads(call.function.arguments)
                result = str(arguments["a"] + arguments["b"])
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            async with httpx.AsyncClient() as http:
                await http.post(
                    str(client.base_url).removesuffix("/").removesuffix("/v1") + "/reward",
                    json={"reward": 0.25},
                    headers={"Authorization": f"Bearer {client.api_key}"},
                )
        return 1.0 if messages[-1].get("content", "").strip() == task["ground_truth"] else 0.0
    finally:
        with open(task["out"], "a") as out:
            out.write(json.dumps({"mode": mode, "seen": seen}) + "\n")


# The same tool as a Responses API function tool (flat, no `function` object).
RESPONSES_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]


async def _responses(task, client, seen, *, chained: bool):
    """The tools loop over the Responses API under a model name of its own: the whole input list each request
    (the Agents SDK's default), or, `chained`, only the new items after previous_response_id."""
    items: list = [{"role": "user", "content": task["prompt"]}]
    previous, new = None, list(items)
    for _ in range(4):
        response = await client.responses.create(
            model="gpt-4o-mini",
            input=new if chained else items,
            tools=RESPONSES_TOOLS,
            instructions="Use the tool.",
            previous_response_id=previous if chained else None,
        )
        seen.append(response.model_dump())
        outputs = [item.model_dump(exclude_none=True) for item in response.output]
        items += outputs
        previous, new = response.id, []
        calls = [item for item in outputs if item["type"] == "function_call"]
        if not calls:
            break
        for call in calls:
            arguments = json.loads(call["arguments"])
            new.append(
                {
                    "type": "function_call_output",
                    "call_id": call["call_id"],
                    "output": str(arguments["a"] + arguments["b"]),
                }
            )
        items += new
    return 1.0 if response.output_text.strip() == task["ground_truth"] else 0.0
