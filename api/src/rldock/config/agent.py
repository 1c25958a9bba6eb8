"""`agent`: the multi-turn rollout's section (docs/agentic.md): its tools and their sandbox, the environment
that answers a turn without a tool call (agent_environment.py), and a user's own agent run through the
gateway (a harness function, a harness command under agent_harness.py's limits, or pods). Its checks across
sections are below (`problems`, rldock.config.problems.SECTION_CHECKS)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field, StringConstraints, field_validator

from rldock.config import agent_environment, agent_harness
from rldock.config.agent_environment import BUILTIN_ENVIRONMENTS, EnvironmentServersSpec, EnvironmentSpec
from rldock.config.agent_harness import HarnessCommandLimits
from rldock.config.problem import Problem
from rldock.config.section import (
    COMMAND,
    MAX_NAME_LENGTH,
    MAX_PATH_LENGTH,
    PATH,
    Spec,
    UserOptions,
    check_class_name,
)
from rldock.contract.algorithms import critic_free_rollout_algorithms, needs_critic, needs_rollout

if TYPE_CHECKING:
    from rldock.config.job import JobConfig

# The built-in tools (runtime/src/rldock/runtime/agent/); anything else is a user's own class, named
# `path/to/file.py:Class` or `package.module:Class` like a reward function.
BUILTIN_TOOLS = ("python", "calculator")


class SandboxSpec(Spec):
    """Limits of the `python` tool's sandbox: each call runs the model's code in a fresh interpreter process
    with no network, in a scratch directory of its own (docs/agentic.md#the-sandbox)."""

    cpu_seconds: float = Field(default=5.0, gt=0, le=600, description="CPU time one program may use (RLIMIT_CPU).")
    wall_seconds: float = Field(
        default=10.0,
        gt=0,
        le=3600,
        description="Wall-clock time one program may run (a program that sleeps or waits uses no CPU) before its "
        "whole process group is killed.",
    )
    memory_mib: int = Field(
        default=512, ge=64, le=1_048_576, description="Address space one program may map (RLIMIT_AS), MiB."
    )
    disk_mib: int = Field(
        default=64,
        ge=1,
        le=65_536,
        description="Bytes one program may write into its scratch directory, all files together, MiB: a tmpfs of "
        "this size where the kernel allows a mount namespace, else a watchdog that stops the program (outcome "
        "`disk_limit`). One file is also capped at 16 MiB or this, whichever is less.",
    )
    max_files: int = Field(
        default=1024,
        ge=1,
        le=1_000_000,
        description="Files and directories one program may create in its scratch directory, enforced as `disk_mib` is.",
    )
    max_output_chars: int = Field(
        default=2000,
        ge=16,
        le=1_048_576,
        description="Characters of the program's stdout and stderr returned to the model; the rest is cut and "
        "the cut is said.",
    )
    allow_missing_layers: list[Literal["landlock"]] = Field(
        default_factory=list,
        max_length=1,
        description="Kernel layers the sandbox may run without on this machine. By default the python tool refuses to "
        "start where the kernel (or the pod's seccomp profile) lacks Landlock, since then the audit hook alone guards "
        "files, which memory-unsafe code gets past; `[landlock]` runs without it anyway, the hook then refusing `..` "
        "in paths and leaving the scratch directory (docs/agentic.md#the-sandbox says what still holds). The seccomp "
        "filter cannot be done without (the hook alone does not stop processes and signals), and namespaces are "
        "never required (a restricted pod has none). `rldock validate` says which layers the machine has.",
    )
    servers: EnvironmentServersSpec | None = Field(
        default=None,
        description="Unset: each program runs in a sandbox process beside the actor (the local default). Set: in "
        "the python sandbox environment rldock ships (`rldock env serve rldock.runtime.agent.sandbox_service:"
        "PythonSandbox`), so the model's code never runs in the trainer's pod; these limits travel with each call.",
    )


class ToolSpec(Spec):
    """One tool the policy may call."""

    name: Annotated[str, PATH] = Field(
        min_length=1,
        max_length=MAX_PATH_LENGTH,
        description="`python` (runs the model's code in the sandbox, see `agent.sandbox`), `calculator` (evaluates "
        "an arithmetic expression), or your own tool class, `path/to/file.py:Class` or `package.module:Class` "
        "(docs/agentic.md#your-own-tool); a relative file path is relative to the working directory of "
        "`rldock train`.",
    )
    options: UserOptions = Field(
        default_factory=dict,
        max_length=64,
        description="Your own tool only: keyword arguments (strings) passed to its class.",
    )

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        return check_class_name(name, BUILTIN_TOOLS, "tool")


class AgentSpec(Spec):
    """Multi-turn rollouts: the policy may call tools and an environment may answer it between turns; the
    whole trajectory is one sample, trained on the model's own tokens only (docs/agentic.md)."""

    tools: list[ToolSpec] = Field(
        default_factory=list,
        max_length=32,
        description="Tools the policy may call, rendered into the prompt by the model's chat template.",
    )
    environment: EnvironmentSpec | None = Field(
        default=None,
        description="What answers a turn that ends without a tool call; unset: that turn ends the episode.",
    )
    max_turns: int = Field(
        default=4,
        ge=1,
        le=256,
        description="Model turns (generations) per episode; the episode also ends at a final answer the "
        "environment accepts (or any final answer without one) and when algorithm.max_response_length, which "
        "counts the model's and the tools' tokens, is used up.",
    )
    tool_call_format: Literal["hermes", "llama3_json", "qwen3_coder"] = Field(
        default="hermes",
        description='How tool calls are written in a generation: `hermes`, `<tool_call>{"name": ..., '
        '"arguments": {...}}</tool_call>` (Hermes, Qwen2.5, Qwen3); `llama3_json`, the turn is `{"name": ..., '
        '"parameters": {...}}` (Llama 3.1-3.3); `qwen3_coder`, `<tool_call><function=NAME><parameter=ARG>value'
        "</parameter></function></tool_call>` (Qwen3-Coder).",
    )
    reasoning_format: Literal["none", "think"] = Field(
        default="none",
        description="How a generation's reasoning is told from its answer in the gateway's answers "
        "(`reasoning_content`): `think`, a `<think>...</think>` block first (Qwen3, DeepSeek-R1); `none`, "
        "no reasoning. The trained ids are the sampled ones either way.",
    )
    harness: Annotated[str | None, PATH] = Field(
        default=None,
        max_length=MAX_PATH_LENGTH,
        pattern=r"^\S+:[A-Za-z_]\w*$",
        description="Your own agent as `module:function` (or `/path/file.py:function`), `async def run(task, "
        "client) -> reward | dict`, given each episode's data row and an `openai.AsyncOpenAI` at the episode's "
        "own endpoint of the rollout engine (docs/agentic.md#bring-your-own-agent); rldock then runs no episode "
        "loop of its own (no agent.tools, no agent.environment).",
    )
    harness_command: Annotated[
        list[Annotated[str, StringConstraints(min_length=1, max_length=MAX_PATH_LENGTH)]] | None, COMMAND
    ] = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="Your own agent as a command run once per episode (docs/agentic.md#the-three-forms). Its "
        "environment is PATH, HOME, LANG, LC_ALL, PYTHONPATH, VIRTUAL_ENV and TMPDIR of the actor's (where set) and: "
        "OPENAI_BASE_URL and OPENAI_API_KEY, the episode's endpoint and key; RLDOCK_TASK_FILE, a file holding the "
        "data row as JSON; RLDOCK_TASK, the same JSON (only when at most 64 KiB); RLDOCK_RESULT_FILE, the file it "
        "writes its result to: a number, a JSON object with `reward` (its other keys kept), or `null` (no reward "
        "but what it posted to the session). Its output is its log, never read for the reward. Exiting 0 without "
        "writing the result file ends the episode `harness_no_result`; exiting non-zero, `harness_exit`. A "
        "relative path is relative to the working directory of `rldock train`; `rldock validate` checks that the "
        "program and, for python or a shell, its script exist.",
    )
    harness_request: Annotated[str | None, PATH] = Field(
        default=None,
        max_length=MAX_PATH_LENGTH,
        description="A harness's first request as `rldock agent capture` wrote it (JSON: the tools and the "
        "system messages it sends before the task's prompt). The job's prompts are then rendered as the gateway "
        "renders that request, so the warm-up's demonstrations (data.demonstration_key) follow the prompt ids an "
        "episode's first turn samples after (docs/agentic.md#a-warm-up-the-gateway-agrees-with); unset: the "
        "prompts carry data.system_prompt only, no tools. `rldock validate` checks that it exists and parses.",
    )
    served_models: list[Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME_LENGTH)]] = Field(
        default_factory=list,
        max_length=64,
        description="The `model` names the rollout's gateway answers a harness's requests for. Empty (the default): "
        "any name is the policy, so an agent written for another provider's model (`gpt-4o-mini`) runs unchanged; "
        "listed: a request naming another is refused with a 400 naming `model`.",
    )
    harness_command_limits: HarnessCommandLimits = Field(
        default_factory=HarnessCommandLimits,
        description="agent.harness_command: the resource limits each of its processes runs under (set before it "
        "starts, inherited by what it starts).",
    )
    max_concurrent_harness_commands: int = Field(
        default=32,
        ge=1,
        le=4096,
        description="agent.harness_command: commands one actor rank runs at once; an episode beyond them waits "
        "for one to end before its command starts (its agent.episode_timeout_s counts from its start).",
    )
    harness_pods: bool = Field(
        default=False,
        description="Your own agent runs in pods that lease each episode from the rollout's gateway (an RLJob's "
        "`spec.agents`; the operator sets this, docs/agentic.md#agents-as-pods): each generating actor rank serves "
        "its episodes on port 8300 of its node and waits for a pod to run them.",
    )
    episode_timeout_s: float = Field(
        default=600.0,
        gt=0,
        le=86_400,
        description="Seconds an episode may take. A harness's (agent.harness, agent.harness_command or a pod's "
        "lease) is cancelled then and ends `agent/ended/harness_timeout`. The native loop's takes no further "
        "turn: it ends `agent/ended/episode_timeout` at the end of the turn or answer under way, and is trained "
        "on as it stands; its environment session stays open until then (sessions have no lifetime of their own).",
    )
    max_tool_response_tokens: int = Field(
        default=256,
        ge=1,
        le=1_048_576,
        description="Tokens of one tool or environment message kept in the trajectory; a longer one is cut "
        "and the cut is said.",
    )
    tool_timeout_s: float = Field(
        default=60.0,
        gt=0,
        le=3600,
        description="Seconds one tool call may take before it is cancelled and the model is told so (the `python` "
        "tool's own agent.sandbox limits stop its program first); an environment's answer that takes longer ends "
        "the episode (`agent/ended/environment_timeout`).",
    )
    max_concurrent_tool_calls: int = Field(
        default=8,
        ge=1,
        le=4096,
        description="Tool calls one rollout engine runs at the same time (the engine keeps generating for the "
        "other samples meanwhile).",
    )
    max_segments: int = Field(
        default=4,
        ge=1,
        le=64,
        description="Dock rows per episode of a harness (agent.harness, agent.harness_command, agent.harness_pods): "
        "each segment of an episode (a request that does not extend its history: a compacted context, stripped "
        "reasoning, a sub-agent's prompt) is one row, every segment sharing the episode's reward and group, its "
        "model tokens trained (docs/agentic.md#segments-train). An episode with fewer segments leaves rows empty (no "
        "token trains or counts); one with more keeps its last segment and its first `max_segments - 1` "
        "(`agent/gateway/segments_dropped`). The dock holds G x N x max_segments rows; 1 trains the last segment "
        "only.",
    )
    sandbox: SandboxSpec = Field(default_factory=SandboxSpec, description="The `python` tool's limits.")

    @property
    def harnessed(self) -> bool:
        """The user's agent runs the episodes (agent.harness, agent.harness_command or agent.harness_pods),
        through the gateway, not rldock's episode loop."""
        return self.harness is not None or self.harness_command is not None or self.harness_pods


def partial_rollout_problem(cfg: JobConfig) -> str | None:
    """Why an agent job's rollout.partial_rollout cannot run, or None. An episode's turn being sampled at a
    weight update is cut and resumed on the new weights (`resume`), the native loop's and a harness's (its
    request to the gateway stays open); `drop` would discard the episode's turns so far; `carry` keeps the
    native loop's episodes open across iterations."""
    agent, mode = cfg.agent, cfg.rollout.partial_rollout
    if agent is None or mode in ("off", "resume"):
        return None
    if mode == "carry":
        if agent.harnessed:
            return (
                "`carry` with agent.harness, agent.harness_command or agent.harness_pods: carried episodes are the "
                "native agent loop's (a harness's episodes run in the user's process, which a batch cannot leave "
                "open); use `resume` or `off`"
            )
        return None
    who = (
        "a harness's episode (agent.harness, agent.harness_command, agent.harness_pods)"
        if agent.harnessed
        else ("an episode")
    )
    return (
        f"`drop` with agent: {who} cut at a weight update keeps its session and its turns so far, and is "
        "resumed on the new weights, never sampled again; use `resume`"
    )


def problems(cfg: JobConfig) -> list[Problem]:
    """Multi-turn rollouts sample the whole episode with the engine, one request per turn, and render
    the tools and the turns with the model's chat template."""
    agent, algo, rollout = cfg.agent, cfg.algorithm, cfg.rollout
    if agent is None:
        return []
    problems: list[Problem] = []
    if not needs_rollout(algo.name):
        problems.append(
            Problem(
                "agent", f"algorithm.name {algo.name} samples no responses, so no tool is ever called; remove agent"
            )
        )
    problem = partial_rollout_problem(cfg)
    if problem is not None:
        problems.append(Problem("rollout.partial_rollout", problem))
    if rollout.stream_groups > 0:
        problems.append(
            Problem(
                "rollout.stream_groups",
                f"{rollout.stream_groups} with agent: episodes are written to the dock when the rank's whole batch "
                "has ended; set 0",
            )
        )
    if cfg.data.chat_template == "none":
        problems.append(
            Problem(
                "data.chat_template",
                "`none` with agent: the model's chat template renders the tools and each turn (tool results, the "
                "environment's messages); use `model` with a model whose tokenizer has a chat template",
            )
        )
    harnessed = agent.harnessed
    if agent.harness is not None and agent.harness_command is not None:
        problems.append(
            Problem("agent.harness_command", "set with agent.harness: an episode runs one harness; keep one of them")
        )
    if agent.harness_pods and (agent.harness is not None or agent.harness_command is not None):
        field = "agent.harness" if agent.harness is not None else "agent.harness_command"
        problems.append(
            Problem(
                field,
                "set with agent.harness_pods: the pods run each episode's harness; remove it (in an RLJob, give "
                "the command to a spec.agents entry)",
            )
        )
    if harnessed and (agent.tools or agent.environment is not None):
        field = "agent.tools" if agent.tools else "agent.environment"
        problems.append(
            Problem(
                field,
                f"set with a harness: your harness runs the episode (its own tools, its own environment) through "
                f"the gateway; remove {field}, or remove the harness to use rldock's episode loop",
            )
        )
    if agent.harness_pods and cfg.evaluation.interval > 0:
        problems.append(
            Problem(
                "evaluation.interval",
                "held-out evaluation does not run agent pods' episodes yet (a harness of the actor's own, "
                "agent.harness or agent.harness_command, it does); set evaluation.interval to 0",
            )
        )
    if not harnessed and not agent.tools and agent.environment is None:
        problems.append(
            Problem(
                "agent",
                "neither tools nor an environment: every episode would be one generation, as without agent; set "
                "agent.tools, agent.environment, agent.harness, or remove agent",
            )
        )
    if harnessed and cfg.rows_per_episode > 1 and needs_critic(algo.name):
        problems.append(
            Problem(
                "agent.max_segments",
                f"{agent.max_segments} trains each segment of a harness's episode as its own row, and {algo.name}'s "
                "critic would bootstrap every segment apart; set agent.max_segments: 1 (the last segment trains) or "
                f"use a critic-free algorithm ({', '.join(critic_free_rollout_algorithms())})",
            )
        )
    if not harnessed and agent.max_tool_response_tokens >= algo.max_response_length:
        problems.append(
            Problem(
                "agent.max_tool_response_tokens",
                f"{agent.max_tool_response_tokens} is not below algorithm.max_response_length "
                f"({algo.max_response_length}), which counts the tools' tokens too: one tool message could use up "
                "the episode; lower it",
            )
        )
    first: dict[str, int] = {}  # built-in tool name -> its first index
    for index, tool in enumerate(agent.tools):
        if tool.name in BUILTIN_TOOLS and tool.name in first:
            problems.append(
                Problem(
                    f"agent.tools[{index}].name",
                    f"`{tool.name}` is listed already (agent.tools[{first[tool.name]}]); list each tool once",
                )
            )
        first.setdefault(tool.name, index)
        if tool.name in BUILTIN_TOOLS and tool.options:
            problems.append(_builtin_options_problem(f"agent.tools[{index}]", tool.name))
    if agent.environment is not None and agent.environment.name in BUILTIN_ENVIRONMENTS and agent.environment.options:
        problems.append(_builtin_options_problem("agent.environment", agent.environment.name))
    problems.extend(agent_environment.problems(cfg))
    problems.extend(agent_harness.problems(cfg))
    return problems


def _builtin_options_problem(at: str, name: str) -> Problem:
    return Problem(
        f"{at}.options",
        f"the built-in `{name}` takes no options (its settings are fields of the agent section); remove them",
    )
