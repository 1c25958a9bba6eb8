"""The gateway end to end on a scripted engine: a stock `openai.AsyncOpenAI` harness over real HTTP, the
dock rows exactly the ids the engine sampled, the failures of a harness counted per episode, and each bad
request answered with OpenAI's error naming the field.

The engine is a test double (rldock_e2e.doubles.scripted_engine); the HTTP server, the client, the sessions,
the parsers and the chat template are the real ones.
"""

from __future__ import annotations

import asyncio
import copy
import json
import string
import sys
import threading
from pathlib import Path

import httpx
import pytest
import torch
import yaml

from rldock.config import parse_job_config
from rldock.runtime.flow.states import ROLLOUT
from rldock.runtime.gateway.answers import RequestError, Turn, chat_request
from rldock.runtime.gateway.episodes import EpisodeResult, GatewayEpisodes
from rldock.runtime.gateway.harness_runner import HarnessError, load_harness
from rldock.runtime.gateway.sessions import SegmentRow
from rldock.runtime.models.tiny import CHAT_TEMPLATE, train_char_tokenizer
from rldock.runtime.rollout.harness import HarnessRollout, harness_columns, result_sums, segment_turn_columns
from rldock.runtime.rollout.protocol import HeldOutRequest, RolloutSetup
from rldock_e2e.doubles.scripted_engine import ScriptedEngine

REPO = Path(__file__).resolve().parents[4]
HARNESS = Path(__file__).with_name("agent_harness.py")
PROMPT_CAPACITY = 64


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = train_char_tokenizer([string.printable])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def job(*, partial: bool = False, **agent) -> object:
    """The tiny example with `agent` running the test harness; with `partial`, its episodes are cut at a weight
    update and resumed (rollout.partial_rollout resume, 4 tokens a round)."""
    data = yaml.safe_load((REPO / "examples" / "grpo-tiny.yaml").read_text())
    data["data"]["chat_template"] = "model"
    data["algorithm"]["max_response_length"] = 256
    data["agent"] = {"harness": f"{HARNESS}:run", **agent}
    data["reward"] = {"terms": [{"name": "environment"}]}
    if partial:
        data["training"] = {**data.get("training", {}), "mode": "async"}
        data["dock"] = {**data.get("dock", {}), "max_staleness": 1}
        data["rollout"] = {
            **data.get("rollout", {}),
            "partial_rollout": "resume",
            "max_tokens_per_round": 4,
            "importance_correction": "behaviour",
        }
    return parse_job_config(data)


@pytest.fixture
def episodes(tokenizer):
    made = []

    def make(**agent):
        made.append(GatewayEpisodes(job(**agent), tokenizer=tokenizer, prompt_capacity=PROMPT_CAPACITY))
        return made[-1]

    yield make
    for item in made:
        item.close()


def tasks_of(tmp_path, *modes, ground_truth="5"):
    out = tmp_path / "seen.jsonl"
    return [{"mode": m, "prompt": "2+3?", "ground_truth": ground_truth, "out": str(out)} for m in modes], out


def seen(out: Path) -> dict[str, list]:
    return {line["mode"]: line["seen"] for line in map(json.loads, out.read_text().splitlines())}


CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def test_a_harness_of_tool_calls_trains_on_exactly_the_sampled_ids(episodes, tokenizer, tmp_path):
    runner = episodes()
    engine = ScriptedEngine(tokenizer, {7: [CALL, "5"]})
    tasks, out = tasks_of(tmp_path, "tools")
    (result,) = runner.run(engine, tasks=tasks, prompts=[[1, 2]], keys=[7], seed=3)
    assert result.ended == "harness_done" and result.turns == 2 and result.tool_calls == 1
    assert result.rewards == [0.25, 1.0]  # the step posted, then the return value
    assert result.reward_turns == [(0, 0), None]  # posted after the first turn; the returned one follows no post
    assert result.segments == ["start"] and result.exact
    first, second = seen(out)["tools"]
    # the answer carries the ids and logprobs, and the call parsed into OpenAI's shape
    assert first["choices"][0]["message"]["tool_calls"][0]["function"] == {
        "name": "add",
        "arguments": '{"a": 2, "b": 3}',
    }
    assert first["choices"][0]["finish_reason"] == "tool_calls"
    assert first["choices"][0]["token_ids"] == tokenizer(CALL, add_special_tokens=False)["input_ids"] + [
        tokenizer.eos_token_id
    ]
    assert len(first["choices"][0]["logprobs"]["content"]) == len(first["choices"][0]["token_ids"])
    # the second turn continued the first exactly: its prompt is the first's, its sampled ids, then the tool's
    assert second["prompt_token_ids"][: len(first["prompt_token_ids"])] == first["prompt_token_ids"]
    after = second["prompt_token_ids"][len(first["prompt_token_ids"]) :]
    assert after[: len(first["choices"][0]["token_ids"])] == first["choices"][0]["token_ids"]
    assert tokenizer.decode(after[len(first["choices"][0]["token_ids"]) :]) == "<tool>5<eos><assistant>"
    # the row: the prompt, then model tokens trained and the tool's masked
    row = result.row
    assert row.ids == [*second["prompt_token_ids"], *second["choices"][0]["token_ids"]]
    trained = [t for t, m in zip(row.ids[row.prompt_length :], row.model_mask) if m]
    assert trained == first["choices"][0]["token_ids"] + second["choices"][0]["token_ids"]
    columns = harness_columns(
        [result], prompt_capacity=PROMPT_CAPACITY, response_capacity=256, max_steps=4, pad_token_id=0, policy_version=0
    )
    assert columns["environment_rewards"][0, :2].tolist() == [0.25, 1.0] and columns["num_environment_steps"][0] == 2
    assert columns["response_mask"].sum() == len(trained)
    # the driver's response length: every token after the prompt, the tool's included
    assert columns["response_length"].tolist() == [len(row.ids) - row.prompt_length]
    assert sorted(set(columns["turn_index"][0].tolist())) == [-1, 0, 1]  # two turns, the tool's tokens none
    # algorithm.credit turn: the posted step's reward on the turn it followed (the returned one goes on the last)
    assert columns["turn_rewards"][0].tolist() == [0.25, 0.0, 0.0, 0.0]
    # Rebuilt from the messages, the first turn would lose its call: this template writes an assistant message's
    # content only, and an answer of calls has none. Every held id from that turn on drifts.
    assert result.drift_tokens == len(row.ids) - len(first["prompt_token_ids"])


def test_a_stream_carries_the_same_answer(episodes, tokenizer, tmp_path):
    runner = episodes()
    tasks, out = tasks_of(tmp_path, "stream")
    (result,) = runner.run(
        ScriptedEngine(tokenizer, {1: ["the sum is 5"]}), tasks=tasks, prompts=[[1]], keys=[1], seed=0
    )
    assert seen(out)["stream"] == ["the sum is 5"] and result.rewards == [1.0]


def test_a_token_id_episode_is_not_rerendered_under_a_template_that_wants_a_user_turn_first(tokenizer, tmp_path):
    strict = copy.deepcopy(tokenizer)
    strict.chat_template = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('a user turn comes first') }}{% endif %}" + CHAT_TEMPLATE
    )
    runner = GatewayEpisodes(job(), tokenizer=strict, prompt_capacity=PROMPT_CAPACITY)
    try:
        tasks, out = tasks_of(tmp_path, "completions")
        (result,) = runner.run(ScriptedEngine(strict, {2: ["5"]}), tasks=tasks, prompts=[[1]], keys=[2], seed=0)
    finally:
        runner.close()
    assert result.ended == "harness_done" and result.turns == 1 and result.exact
    assert result.row.ids[: result.row.prompt_length] == [1, 5, 6]
    assert result.drift_tokens is None  # its history is the answer alone: not a conversation to render again
    assert result_sums([result], engine_s=0.0, wall_s=0.0)["counts/gateway/rerender_drifted"] == 0


def test_failing_harnesses_end_their_episodes_counted_and_the_others_go_on(episodes, tokenizer, tmp_path):
    # A timeout far past any machine's time for these episodes: how fast the machine is never decides an outcome.
    runner = episodes(episode_timeout_s=120)
    modes = ("raise", "silent", "bad_reward", "stream")
    tasks, _ = tasks_of(tmp_path, *modes)
    engine = ScriptedEngine(tokenizer, {k: ["ok"] for k in range(len(modes))})
    results = runner.run(engine, tasks=tasks, prompts=[[1, 2]] * len(modes), keys=list(range(len(modes))), seed=0)
    assert [r.ended for r in results] == ["harness_error", "harness_no_turn", "harness_bad_reward", "harness_done"]
    # every episode has a turn of the model's to train on: those that never reached it got one on their prompt
    assert all(sum(r.row.model_mask) > 0 for r in results)
    sums = result_sums(results, engine_s=0.0, wall_s=0.0)
    assert sums["ended/harness_error"] == 1 and sums["counts/gateway/exact_episodes"] == 4


def test_a_hanging_harness_is_cancelled_at_the_episode_timeout(episodes, tokenizer, tmp_path):
    runner = episodes(episode_timeout_s=0.2)  # it never returns: any timeout ends it
    tasks, _ = tasks_of(tmp_path, "hang")
    (result,) = runner.run(ScriptedEngine(tokenizer, {0: ["ok"]}), tasks=tasks, prompts=[[1, 2]], keys=[0], seed=0)
    assert result.ended == "harness_timeout" and sum(result.row.model_mask) > 0
    assert result_sums([result], engine_s=0.0, wall_s=0.0)["ended/harness_timeout"] == 1


def test_a_command_harness_gets_the_endpoint_in_its_environment(episodes, tokenizer, tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(
        "import json, os, openai\n"
        "task = json.loads(os.environ['RLDOCK_TASK'])\n"
        "client = openai.OpenAI()\n"
        "messages = [{'role': 'user', 'content': task['prompt']}]\n"
        "answer = client.chat.completions.create(model='policy', messages=messages)\n"
        "reward = float(answer.choices[0].message.content == task['ground_truth'])\n"
        "open(os.environ['RLDOCK_RESULT_FILE'], 'w').write(json.dumps({'reward': reward}))\n"
        "print('noise')\n"
    )
    failing = tmp_path / "fail.py"
    failing.write_text("import sys\nprint('it went wrong')\nsys.exit(3)\n")
    tasks, _ = tasks_of(tmp_path, "command")
    good = episodes(harness=None, harness_command=[sys.executable, str(script)])
    (result,) = good.run(ScriptedEngine(tokenizer, {4: ["5"]}), tasks=tasks, prompts=[[1]], keys=[4], seed=0)
    assert result.ended == "harness_done" and result.rewards == [1.0] and result.turns == 1
    bad = episodes(harness=None, harness_command=[sys.executable, str(failing)])
    tasks, _ = tasks_of(tmp_path, "command", "command")
    # one harness that exits non-zero among others ends its episode (counted); every one of a batch stops the job
    with pytest.raises(HarnessError, match="every episode of the batch .2. failed.*agent.harness_command exited 3"):
        bad.run(ScriptedEngine(tokenizer, {4: ["5"], 5: ["5"]}), tasks=tasks, prompts=[[1]] * 2, keys=[4, 5], seed=0)


def test_the_documented_command_harness_trains_as_written(episodes, tokenizer, tmp_path):
    text = (REPO / "docs" / "agentic.md").read_text()
    start = text.index("# agent.py: its result goes to the file rldock names")
    script = tmp_path / "agent.py"
    script.write_text(text[start : text.index("```", start)])
    runner = episodes(harness=None, harness_command=[sys.executable, str(script)])
    tasks, _ = tasks_of(tmp_path, "command")
    (result,) = runner.run(ScriptedEngine(tokenizer, {4: ["5"]}), tasks=tasks, prompts=[[1]], keys=[4], seed=0)
    assert result.ended == "harness_done" and result.rewards == [1.0] and result.turns == 1 and result.exact


@pytest.mark.parametrize(
    ("mode", "ended", "says"),
    [
        # a reward printed as the command's last line, but no result file written
        ("printed", "harness_no_result", "agent.harness_command exited 0 without writing its result"),
        ("bad_reward", "harness_bad_reward", "agent.harness: the reward 'great' is not a finite number"),
    ],
)
def test_a_batch_whose_every_episode_fails_the_same_way_stops_the_rollout_naming_the_reason(
    episodes, tokenizer, tmp_path, mode, ended, says
):
    printed = tmp_path / "printed.py"
    printed.write_text(
        "import openai\n"
        "openai.OpenAI().chat.completions.create(model='policy', messages=[{'role': 'user', 'content': '2+3?'}])\n"
        "print(1.0)\n"
    )
    runner = episodes(harness=None, harness_command=[sys.executable, str(printed)]) if mode == "printed" else episodes()
    tasks, _ = tasks_of(tmp_path, mode, mode)
    with pytest.raises(HarnessError, match=rf"every episode of the batch \(2\) .* each ended {ended}; .*{says}"):
        runner.run(ScriptedEngine(tokenizer, {0: ["5"], 1: ["5"]}), tasks=tasks, prompts=[[1]] * 2, keys=[0, 1], seed=0)


def test_a_harness_that_raises_on_every_episode_stops_the_rollout_naming_it(episodes, tokenizer, tmp_path):
    runner = episodes()
    tasks, _ = tasks_of(tmp_path, "raise", "raise")
    with pytest.raises(HarnessError, match="agent.harness raised RuntimeError: the harness broke"):
        runner.run(ScriptedEngine(tokenizer, {0: ["5"], 1: ["5"]}), tasks=tasks, prompts=[[1]] * 2, keys=[0, 1], seed=0)
    assert runner.gateway.episodes == {}  # closed before the refusal


# --- bad input: OpenAI's 400s, 401, 429 ------------------------------------------------------------


@pytest.fixture
def served(episodes, tokenizer):
    """A gateway with one open episode and the engine pumping in a thread: (base url, key, engine, runner)."""
    runner = episodes()
    hold = threading.Event()
    hold.set()
    engine = ScriptedEngine(tokenizer, {9: ["5"] * 8}, hold=hold)
    episode = runner.server.run(_open(runner, "e9", 9)).result()
    keys = [9, 10, 11]  # the episodes the tests open
    runner.turns.open(keys)
    pump = threading.Thread(
        target=runner.turns.pump,
        args=(engine,),
        kwargs={"keys": keys, "eos_token_id": tokenizer.eos_token_id, "seed": 0},
    )
    pump.start()
    yield runner.server.base_url("e9"), episode.token, engine, runner, hold
    hold.set()
    for key in keys:
        runner.turns.end(key)
    pump.join()


async def _open(runner, name, key):
    return runner.gateway.open(name, key=key)


def post(url, key, body, *, raw=None):
    return httpx.post(
        url, content=raw, json=None if raw is not None else body, headers={"Authorization": f"Bearer {key}"}, timeout=30
    )


USER = [{"role": "user", "content": "2+3?"}]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"model": "policy", "messages": USER, "n": 2}, "n", "one choice per request"),
        ({"model": "policy", "messages": USER, "tool_choice": "required"}, "tool_choice", "guided decoding"),
        (
            {"messages": USER, "tool_choice": {"type": "function", "function": {"name": "add"}}},
            "tool_choice",
            "use `auto` (the model chooses) or `none`",
        ),
        ({"messages": USER, "response_format": {"type": "json_object"}}, "response_format", "'json_object'"),
        ({"model": "policy", "messages": []}, "messages", "non-empty"),
        ({"model": "policy", "messages": USER, "max_tokens": 0}, "max_tokens", "positive integer"),
        ({"model": "policy", "messages": [{"role": "user", "content": "x" * 400}]}, "messages", "leaves no token"),
        (
            {"model": "policy", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages",
            "image_url",
        ),
    ],
)
def test_a_request_the_engine_cannot_serve_is_a_400_naming_the_field(served, body, param, words):
    url, key, engine, _, _ = served
    answer = post(f"{url}/chat/completions", key, body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"] and error["type"] == "invalid_request_error"
    assert engine.submitted == 0


def test_any_model_name_is_the_policy_unless_the_job_lists_the_served_names(served, episodes):
    url, key, engine, _, _ = served
    for name in ("gpt-4o-mini", "policy"):  # an agent written for another provider's model runs unchanged
        answer = post(
            f"{url}/chat/completions", key, {"model": name, "messages": USER + [{"role": "user", "content": name}]}
        )
        assert answer.status_code == 200, answer.text
    listed = episodes(served_models=["policy", "qwen"]).gateway.shaper
    assert listed.served == ("policy", "qwen")
    with pytest.raises(RequestError) as refused:
        chat_request({"model": "gpt-4o", "messages": USER}, served=listed.served)
    assert refused.value.param == "model" and "'gpt-4o' is not served here" in str(refused.value)
    assert "'policy', 'qwen' (agent.served_models)" in str(refused.value)
    assert chat_request({"model": "qwen", "messages": USER}, served=listed.served).tool_calls


def test_tool_choice_none_leaves_a_call_the_model_wrote_in_the_text(episodes, tokenizer):
    shaper = episodes().gateway.shaper
    ids = tokenizer(CALL, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    turn = Turn(prompt_ids=[1, 2], token_ids=ids, logprobs=None, ended=True)
    assert shaper.message(turn, call_prefix="c")["tool_calls"][0]["function"]["name"] == "add"  # auto
    plain = shaper.message(turn, call_prefix="c", tool_calls=False)
    assert "tool_calls" not in plain and plain["content"] == CALL
    assert not chat_request({"messages": USER, "tool_choice": "none"}, served=()).tool_calls
    assert chat_request({"messages": USER, "tool_choice": "auto", "response_format": {"type": "text"}}, served=())


def test_a_body_over_the_limit_is_refused_before_it_is_read_whole(served):
    url, key, engine, runner, _ = served
    runner.gateway.max_body_bytes = 1000
    answer = post(f"{url}/chat/completions", key, None, raw=b"{" + b" " * 5000 + b"}")
    assert answer.status_code == 400 and "past the limit of 1000" in answer.json()["error"]["message"]


def test_a_key_opens_only_its_own_session(served):
    url, key, _, runner, _ = served
    other = runner.server.run(_open(runner, "e10", 10)).result()
    assert post(f"{url}/chat/completions", other.token, {"messages": USER}).status_code == 401
    assert httpx.post(f"{url}/chat/completions", json={"messages": USER}).status_code == 401  # no key
    assert post(runner.server.base_url("nope") + "/chat/completions", key, {"messages": USER}).status_code == 401


def test_a_resend_is_answered_from_the_record_not_sampled_twice(served):
    url, key, engine, _, _ = served
    body = {"model": "policy", "messages": USER, "temperature": 0.7}
    first = post(f"{url}/chat/completions", key, body).json()
    again = post(f"{url}/chat/completions", key, body).json()
    assert first == again and engine.submitted == 1


def test_turns_beyond_the_engines_limit_get_a_429_with_retry_after(served):
    url, key, engine, runner, hold = served
    runner.gateway.max_waiting = 1
    hold.clear()  # the engine holds the first turn
    waiting = threading.Thread(target=post, args=(f"{url}/chat/completions", key, {"messages": USER}))
    waiting.start()
    other = runner.server.run(_open(runner, "e11", 11)).result()
    try:
        while runner.turns.waiting < 1:  # the state the refusal needs: a turn waiting for the engine
            threading.Event().wait(0.005)
        answer = post(f"{url.replace('e9', 'e11')}/chat/completions", other.token, {"messages": USER})
        assert answer.status_code == 429 and answer.headers["retry-after"] == "1"
    finally:
        hold.set()
        waiting.join()


def test_completions_take_token_ids_and_continue_them(served, tokenizer):
    url, key, engine, runner, _ = served
    answer = post(f"{url}/completions", key, {"model": "policy", "prompt": [1, 5, 6], "logprobs": 0})
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert answer.json()["prompt_token_ids"] == [1, 5, 6] and choice["token_ids"] == [
        *tokenizer("5", add_special_tokens=False)["input_ids"],
        tokenizer.eos_token_id,
    ]
    assert post(f"{url}/completions", key, {"prompt": "text"}).json()["error"]["param"] == "prompt"


@pytest.mark.parametrize("bad", [-1, "vocab"])
def test_a_token_id_outside_the_vocabulary_is_a_400_naming_the_prompt(served, tokenizer, bad):
    url, key, engine, _, _ = served
    token = len(tokenizer) if bad == "vocab" else bad
    answer = post(f"{url}/completions", key, {"model": "policy", "prompt": [1, token, 6]})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "prompt" and f"token id {token}" in error["message"]
    assert engine.submitted == 0  # refused before the engine


def test_the_harness_is_checked_when_loaded(tmp_path):
    sync = tmp_path / "sync.py"
    sync.write_text("def run(task, client):\n    return 1\n")
    one = tmp_path / "one.py"
    one.write_text("async def run(task):\n    return 1\n")
    with pytest.raises(HarnessError, match="agent.harness: .* is not `async def`"):
        load_harness(f"{sync}:run")
    with pytest.raises(HarnessError, match=r"cannot be called as run\(task, client\)"):
        load_harness(f"{one}:run")
    with pytest.raises(ValueError, match="agent.harness"):
        load_harness(f"{tmp_path / 'missing.py'}:run")
    assert asyncio.iscoroutinefunction(load_harness(f"{HARNESS}:run"))


# --- the engine's side: a refused turn, a turn after the rollout stopped ------------------------------------


class RefusingEngine(ScriptedEngine):
    """The scripted engine, refusing every turn of the sample keys in `refuse` as vLLM refuses a request it
    cannot take (a ValueError from its checks)."""

    def __init__(self, tokenizer, script, *, refuse):
        super().__init__(tokenizer, script)
        self.refuse = refuse

    def submit(self, prompts, *, request_keys, **kwargs):
        if any(key[0] in self.refuse for key in request_keys):
            raise ValueError("the prompt is longer than the model's context")
        return super().submit(prompts, request_keys=request_keys, **kwargs)


def test_a_turn_the_engine_refuses_ends_its_episode_counted_and_the_others_go_on(episodes, tokenizer, tmp_path):
    runner = episodes(episode_timeout_s=120)
    tasks, _ = tasks_of(tmp_path, "stream", "stream")
    engine = RefusingEngine(tokenizer, {0: ["5"], 1: ["the sum is 5"]}, refuse={0})
    refused, served = runner.run(engine, tasks=tasks, prompts=[[1, 2]] * 2, keys=[0, 1], seed=0)
    assert refused.ended == "engine_refused" and sum(refused.row.model_mask) > 0  # a fallback turn to train
    assert served.ended == "harness_done" and served.rewards == [1.0]
    assert result_sums([refused, served], engine_s=0.0, wall_s=0.0)["ended/engine_refused"] == 1


def test_a_turn_asked_after_its_harness_ended_is_a_503_not_a_wait(episodes, tokenizer):
    runner = episodes()
    episode = runner.server.run(_open(runner, "e12", 12)).result()
    runner.turns.open([12])
    pump = threading.Thread(
        target=runner.turns.pump,
        args=(ScriptedEngine(tokenizer, {12: ["5"]}),),
        kwargs={"keys": [12], "eos_token_id": tokenizer.eos_token_id, "seed": 0},
    )
    pump.start()
    runner.turns.end(12)
    pump.join()
    answer = post(runner.server.base_url("e12") + "/chat/completions", episode.token, {"messages": USER})
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "episode_over"
    assert runner.turns.waiting == 0


# --- held-out evaluation runs the harness ---------------------------------------------------------------------


class GreedyRecordingEngine(ScriptedEngine):
    """The scripted engine, recording whether each turn was asked greedy."""

    def __init__(self, tokenizer, script):
        super().__init__(tokenizer, script)
        self.greedy: list[bool] = []

    def submit(self, prompts, *, greedy=False, **kwargs):
        self.greedy.extend([greedy] * len(prompts))
        return super().submit(prompts, greedy=greedy, **kwargs)


def test_held_out_evaluation_runs_the_harness_greedily_and_answers_its_final_turns(tokenizer, tmp_path):
    rollout = HarnessRollout(
        RolloutSetup(
            rank=0,
            batch_size=2,
            spec=ROLLOUT,
            num_responses=2,
            max_response_length=256,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            num_prompts_per_iteration=1,
        ),
        job(),
        tokenizer=tokenizer,
    )
    tasks, out = tasks_of(tmp_path, "tools", "tools", ground_truth="5")
    # two held-out prompts, two samples each: episode key = prompt key * 2 + sample
    engine = GreedyRecordingEngine(tokenizer, {20: [CALL, "5"], 21: [CALL, "5"], 22: ["7"], 23: [CALL, "5"]})
    request = HeldOutRequest(
        prompts=[[1], [1, 2]], num_samples=2, greedy=True, max_tokens=256, seed=1, prompt_keys=[10, 11], tasks=tasks
    )
    try:
        answer = rollout.evaluate(engine, request)
    finally:
        rollout.close()
    assert engine.greedy and all(engine.greedy)
    five = [*tokenizer("5", add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    seven = [*tokenizer("7", add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    assert answer["responses"] == [[five, five], [seven, five]]  # each episode's final turn
    # the harness's rewards: a posted step per tool call, then its return value (1 when it answered 5)
    assert answer["environment_rewards"] == [[[0.25, 1.0], [0.25, 1.0]], [[0.0], [0.25, 1.0]]]
    assert answer["agent"]["episodes"] == 4 and answer["agent"]["turns"] == 7
    assert len(seen(out)["tools"]) == 2  # the file keeps the last episode's record per mode


def test_every_segment_of_a_compacting_harness_is_a_row_of_its_episode(episodes, tokenizer, tmp_path):
    runner = episodes()
    tasks, out = tasks_of(tmp_path, "compact")
    (result,) = runner.run(
        ScriptedEngine(tokenizer, {9: ["7", "6", "5", "4"]}), tasks=tasks, prompts=[[1, 2]], keys=[9], seed=0
    )
    assert seen(out)["compact"] == ["7", "6", "5", "4"]
    # a summary in place of the conversation edits its first message: the gateway names it so
    assert result.segments == ["start", "message_edited", "message_edited"] and result.turns == 4 and result.exact
    turns = runner.turns.sampled[9]  # the engine's ids of each turn, in order
    by_segment = [turns[0], turns[1] + turns[2], turns[3]]

    def dock_rows(rows_per_episode: int):
        return harness_columns(
            [result],
            rows_per_episode=rows_per_episode,
            prompt_capacity=PROMPT_CAPACITY,
            response_capacity=256,
            max_steps=4,
            pad_token_id=0,
            policy_version=0,
        )

    def trained(columns) -> list[list[int]]:
        return [ids[mask.bool()].tolist() for ids, mask in zip(columns["response_ids"], columns["response_mask"])]

    columns = dock_rows(4)
    # the last segment first (the reward judges its final turn), then the earlier ones in order, then an empty row
    assert trained(columns) == [by_segment[2], by_segment[0], by_segment[1], []]
    assert columns["response_mask"][3].sum() == 0 and columns["response_length"][3] == 0
    assert torch.equal(columns["prompt_ids"][3], columns["prompt_ids"][0])
    assert columns["environment_rewards"][:, 0].tolist() == [1.0] * 4  # every row carries the episode's reward
    sums = result_sums([result], engine_s=0.0, wall_s=0.0, rows_per_episode=4)
    assert sums["counts/gateway/segments"] == 3 and sums["counts/gateway/segments_dropped"] == 0
    assert not any("untrained" in key for key in sums)
    # a cap of 2 rows keeps the last segment and the first; the middle one is counted by its reason
    assert trained(dock_rows(2)) == [by_segment[2], by_segment[0]]
    sums = result_sums([result], engine_s=0.0, wall_s=0.0, rows_per_episode=2)
    assert sums["counts/gateway/segments_dropped"] == 1 and sums["counts/gateway/segment_dropped/message_edited"] == 1


# --- a turn across a weight update (rollout.partial_rollout resume) ------------------------------------------


def test_a_turn_cut_at_a_weight_update_is_resumed_and_answered_once_whole(tokenizer, tmp_path):
    """The first round (4 tokens an episode) cuts episode 7's turn after 4 tokens and holds its request open;
    episode 8's shorter turn ends within the round. After the update the rest of the turn is sampled on the new
    weights from the 4 tokens, and the harness gets one answer: the whole turn, each token's logprob that of
    the weights that sampled it; the session holds each token's version."""
    runner = GatewayEpisodes(job(partial=True), tokenizer=tokenizer, prompt_capacity=PROMPT_CAPACITY)
    engine = ScriptedEngine(tokenizer, {7: ["the sum is 5"], 8: ["5"]})
    whole = [*tokenizer("the sum is 5", add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    tasks, out = tasks_of(tmp_path, "tools", "stream")
    try:
        batch = runner.start(tasks=tasks, prompts=[[1, 2], [1, 2]], keys=[7, 8], seed=3)
        assert not runner.advance(engine, batch, policy_version=0, round_tokens=4)
        assert batch.unfinished == {7} and batch.rounds[0].sampled == {7: 4, 8: 2}
        # the cut turn's request is still open, unanswered: its harness has not ended, the other's has
        assert runner.turns.waiting == 1 and runner.turns.running() == {7} and list(seen(out)) == ["stream"]
        engine.version = 1  # the weight update
        assert runner.advance(engine, batch, policy_version=1)
        result, short = runner.results(engine, batch)
    finally:
        runner.close()
    # the rest was asked from the 4 tokens sampled, under a key of its own
    assert engine.prompts[(7, 1, 4)] == [*engine.prompts[(7, 1)], *whole[:4]] and engine.submitted == 3
    (answer,) = seen(out)["tools"]  # one answer: the whole turn, no cut and no duplicate
    choice = answer["choices"][0]
    assert choice["token_ids"] == whole and choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == "the sum is 5"
    assert [entry["logprob"] for entry in choice["logprobs"]["content"]] == [-1.0] * 4 + [-2.0] * (len(whole) - 4)
    assert runner.turns.sampled[7] == [whole] and result.exact and result.ended == "harness_done"
    row = result.row
    model = [i for i, m in enumerate(row.model_mask) if m]
    assert [row.ids[row.prompt_length + i] for i in model] == whole
    assert [row.versions[i] for i in model] == [0] * 4 + [1] * (len(whole) - 4)  # straddling the update
    assert [row.logprobs[i] for i in model] == [-1.0] * 4 + [-2.0] * (len(whole) - 4)
    assert all(row.versions[i] == -1 for i, m in enumerate(row.model_mask) if not m)
    assert [short.row.versions[i] for i, m in enumerate(short.row.model_mask) if m] == [0, 0]


def _segment(turn_index: list[int]) -> SegmentRow:
    mask = [int(turn >= 0) for turn in turn_index]
    return SegmentRow([1, *range(2, 2 + len(mask))], 1, mask, "start", [0] * len(mask), [0.0] * len(mask), turn_index)


def test_a_posted_reward_is_credited_to_the_turn_it_followed_in_its_segment_s_row():
    first, last = _segment([0, -1, 1, -1, 2]), _segment([0, 0, -1, 1, 2, 3, 4])
    result = EpisodeResult(
        row=last,
        ended="harness_done",
        rewards=[0.5, 0.1, 0.2, 0.3, 0.4, 1.0],
        turns=8,
        tool_calls=0,
        rows=[first, last],
        # posted after segment 0's turns 0 and 2 and segment 1's turns 1, 3 and 4; then the returned one
        reward_turns=[(0, 0), (0, 2), (1, 1), (1, 3), (1, 4), None],
    )
    # max_steps 4 keeps the latest 4 rewards (the environment term's): segment 0's two posts are left out, and
    # segment 1's turns past the fourth count as its fourth
    assert segment_turn_columns(result, 0, max_steps=4) == ([0, -1, 1, -1, 2], [0.0, 0.0, 0.0])
    assert segment_turn_columns(result, 1, max_steps=4) == ([0, 0, -1, 1, 2, 3, 3], [0.0, 0.2, 0.0, 0.7])
    # with room for every reward, each post lands on its own turn
    assert segment_turn_columns(result, 0, max_steps=8)[1] == [0.5, 0.0, 0.1]
    columns = harness_columns(
        [result],
        rows_per_episode=2,
        prompt_capacity=4,
        response_capacity=8,
        max_steps=4,
        pad_token_id=0,
        policy_version=0,
    )
    expected = torch.tensor([[0.0, 0.2, 0.0, 0.7], [0.0, 0.0, 0.0, 0.0]])  # float32; the last segment's row first
    assert torch.equal(columns["turn_rewards"], expected)
    assert columns["turn_index"][0, :7].tolist() == [0, 0, -1, 1, 2, 3, 3]
