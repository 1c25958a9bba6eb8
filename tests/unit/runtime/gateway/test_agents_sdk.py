"""The OpenAI Agents SDK agent of examples/harnesses/openai_agents_sdk_agent.py, unchanged (the SDK's default
Responses API model, tracing on, a model name of its own, exceptions uncaught), runs an episode as
`agent.harness_command` through the gateway: its tool call parsed into a function_call item, the tool's
output sent back as the SDK sends it, one segment, the row exactly the sampled ids, its reward from its
result file while the SDK's tracing complains on stderr; and its first request, captured once (`rldock agent
capture`, gateway/capture.py), renders the job's prompts, so the warm-up trains after the ids the gateway's
first turn samples after.

The SDK runs in a virtualenv of its own, as the example's header says (its websockets pin keeps it out of
rldock's lock): made once from examples/harnesses/openai-agents-requirements.txt in ~/.cache/rldock, keyed
by that file's hash (pip from PyPI, about a minute the first time). The engine is the scripted test double
(rldock_e2e.doubles.scripted_engine); the SDK, the HTTP server and the chat template are real.
"""

from __future__ import annotations

import hashlib
import string
import subprocess
import sys
from pathlib import Path

import pytest
from test_gateway import CALL, REPO, job

from rldock.config import JobConfig
from rldock.runtime.agent.builders import job_conversation
from rldock.runtime.data import PromptDataset, Row
from rldock.runtime.gateway.capture import capture_first_request
from rldock.runtime.gateway.episodes import GatewayEpisodes
from rldock.runtime.models.tiny import CHAT_TEMPLATE, train_char_tokenizer
from rldock_e2e.doubles.scripted_engine import ScriptedEngine

EXAMPLE = REPO / "examples" / "harnesses" / "openai_agents_sdk_agent.py"
REQUIREMENTS = EXAMPLE.with_name("openai-agents-requirements.txt")
# A template that ignores `tools=` (as SmolLM2's does): the gateway describes the tools in the system message,
# their JSON as the request sent it.
TOOLS_IN_SYSTEM_TEMPLATE = CHAT_TEMPLATE[CHAT_TEMPLATE.index("{% for message") :]


@pytest.fixture(scope="module")
def sdk_python() -> Path:
    """The SDK's virtualenv's interpreter, made (once per requirements file) as the example's header says."""
    key = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()[:12]
    venv = Path.home() / ".cache" / "rldock" / f"openai-agents-{key}"
    python = venv / "bin" / "python"
    if not (venv / "ready").is_file():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        subprocess.run([*pip, "-r", str(REQUIREMENTS)], check=True, timeout=900)
        (venv / "ready").write_text(REQUIREMENTS.read_text())
    return python


def test_an_unchanged_agents_sdk_agent_trains_one_exact_segment(sdk_python, tmp_path):
    tokenizer = train_char_tokenizer([string.printable])
    tokenizer.chat_template = CHAT_TEMPLATE
    episodes = GatewayEpisodes(
        job(harness=None, harness_command=[str(sdk_python), str(EXAMPLE)]), tokenizer=tokenizer, prompt_capacity=64
    )
    try:
        engine = ScriptedEngine(tokenizer, {7: [CALL, "5"]})
        task = {"prompt": "2+3?", "ground_truth": "5"}
        (result,) = episodes.run(engine, tasks=[task], prompts=[[1, 2]], keys=[7], seed=3)
    finally:
        episodes.close()
    assert result.ended == "harness_done" and result.rewards == [1.0]
    assert result.turns == 2 and result.tool_calls == 1
    assert result.segments == ["start"] and result.exact
    # the second turn's prompt held the first turn as sampled, then the SDK's tool output (add's 5)
    first_prompt, second_prompt = engine.prompts[(7, 1)], engine.prompts[(7, 2)]
    first_turn = tokenizer(CALL, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert tokenizer.decode(first_prompt) == "<tools>add</tools><system>Use the tool.<eos><user>2+3?<eos><assistant>"
    assert second_prompt[: len(first_prompt)] == first_prompt
    assert second_prompt[len(first_prompt) :][: len(first_turn)] == first_turn
    assert tokenizer.decode(second_prompt[len(first_prompt) + len(first_turn) :]) == "<tool>5<eos><assistant>"


def _sdk_job(sdk_python: Path, **agent) -> JobConfig:
    cfg = job(harness=None, harness_command=[str(sdk_python), str(EXAMPLE)], **agent)
    return cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(update={"max_prompt_length": 1024})})


def test_the_warm_up_renders_prompts_as_the_gateway_renders_the_sdks_first_request(sdk_python, tmp_path):
    tokenizer = train_char_tokenizer([string.printable])
    tokenizer.chat_template = TOOLS_IN_SYSTEM_TEMPLATE
    task = {"prompt": "2+3=", "ground_truth": "5"}
    capture = capture_first_request(_sdk_job(sdk_python), tokenizer=tokenizer, task=task, prompt="2+3=")
    assert capture.ended == "harness_done" and capture.summary["prompt_ids_equal"]
    assert capture.request.messages == [{"role": "system", "content": "Use the tool."}]
    assert [tool["function"]["name"] for tool in capture.request.tools] == ["add"]
    request_file = tmp_path / "request.json"
    request_file.write_text(capture.request.to_json())
    cfg = _sdk_job(sdk_python, harness_request=str(request_file))
    row = Row(prompt="2+3=", ground_truth="5", data_source="addition")

    def warm_up_prompt(cfg: JobConfig) -> list[int]:  # what run_warmup trains after: the prompt set's ids
        conversation = job_conversation(cfg, tokenizer)
        dataset = PromptDataset(
            [row], tokenizer=tokenizer, spec=cfg.data, max_prompt_length=1024, conversation=conversation
        )
        return dataset.prompt_ids([0])[0]

    # an episode as the job runs it: the ids the engine's first turn samples after
    episodes = GatewayEpisodes(cfg, tokenizer=tokenizer, prompt_capacity=1024)
    try:
        engine = ScriptedEngine(tokenizer, {7: [CALL, "5"]})
        (result,) = episodes.run(engine, tasks=[task], prompts=[[1, 2]], keys=[7], seed=3)
    finally:
        episodes.close()
    assert result.ended == "harness_done" and result.exact
    first_prompt = engine.prompts[(7, 1)]
    assert warm_up_prompt(cfg) == first_prompt == capture.gateway_ids
    assert '"description": "Adds two numbers."' in tokenizer.decode(first_prompt)
    # without the capture the job's prompt has neither the SDK's instructions nor its tool
    uncaptured = warm_up_prompt(_sdk_job(sdk_python))
    assert tokenizer.decode(uncaptured) == "<user>2+3=<eos><assistant>"
