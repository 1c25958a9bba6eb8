"""`data`: where the prompts come from (docs/bring-your-own.md): files (jsonl, parquet, verl's layout)
or a built-in generator, the keys each row is read by, chat rendering and the demonstrations of a
warm-up, with the checks that need more than one field (`problems`,
rldock.config.problems.SECTION_CHECKS)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field

from rldock.config.problem import Problem
from rldock.config.section import MAX_NAME_LENGTH, PATH, DataFile, Spec

if TYPE_CHECKING:
    from rldock.config.job import JobConfig


class GeneratorSpec(Spec):
    """A built-in generator that writes the prompt set as jsonl files before the job loads them.

    The files land in `<output>/data/train.jsonl` (and `val.jsonl`) and are then read by the same
    loader as user files, with the keys the `data` section names (`prompt_key`, `answer_key`; the
    data source goes to `data_source_key`, default column `data_source`)."""

    name: Literal["addition", "word_problems"] = Field(
        description="`addition`: prompts like `37+58=` with the sum as answer (the tiny demo's task). "
        "`word_problems`: easy arithmetic in words, GSM8K format (a question; a short worked solution "
        "ending in `#### <number>`).",
    )
    num_prompts: int = Field(
        default=20000, ge=1, le=10**7, description="Rows of the generated train set that iterations draw from."
    )
    num_val_prompts: int = Field(
        default=0,
        ge=0,
        le=10**6,
        description="Rows of the generated validation set (`val.jsonl`); word problems never repeat a "
        "train question there.",
    )
    max_operand: int = Field(default=99, ge=1, le=10**6, description="`addition`: largest operand drawn (inclusive).")
    operations: list[Literal["add", "subtract", "multiply", "share"]] = Field(
        default=["add", "subtract", "multiply", "share"],
        min_length=1,
        max_length=4,
        description="`word_problems`: the kinds of problem drawn, each equally often (the difficulty "
        "knob: a 135M model is partly right on `add` and `subtract`, rarely on `multiply` and `share`).",
    )
    max_number: int = Field(
        default=20,
        ge=3,
        le=10**6,
        description="`word_problems`: largest number added or given away (inclusive); the factors of "
        "`multiply` and `share` stay at most min(max_factor, max_number).",
    )
    max_factor: int = Field(
        default=10,
        ge=2,
        le=10**6,
        description="`word_problems`: largest factor of `multiply` and `share` (inclusive, and at most "
        "`max_number`); 999 with `max_number: 999` gives products of 3-digit numbers.",
    )
    tool_demonstrations: Literal["python", "calculator"] | None = Field(
        default=None,
        description="Also write each row's solution with this tool (column `data.demonstration_key`, default "
        "`demonstration`): a call that computes the answer, the tool's reply and the final answer in the "
        "task's format, which `warmup` trains on when the raw model never calls the tool. The job's "
        "`agent.tools` must list the tool.",
    )


class DataSpec(Spec):
    """The prompts and reference answers: jsonl/json/parquet files (or a generator that writes them),
    how a prompt becomes the model's input text, and which columns the rewards read.

    Leaving the section out means the tiny demo's data: the `addition` generator (operands 0-99,
    20000 prompts) with `chat_template: none`; only a model that `model.builder` builds may leave it
    out (a model of your own is refused without it)."""

    train_files: Annotated[list[DataFile], PATH] = Field(
        default=[],
        max_length=1000,
        description="Train files (`.jsonl`, `.json`, `.parquet`) on a local path or mounted volume, read "
        "with Hugging Face `datasets` (never from the Hub) and concatenated in order. Exactly one of "
        "`train_files` and `generator` is set.",
    )
    val_files: Annotated[list[DataFile], PATH] = Field(
        default=[],
        max_length=1000,
        description="Held-out files in the same format, for evaluation.",
    )
    prompt_key: str = Field(
        default="prompt",
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        description="Column holding the prompt: a string, or a list of chat messages `{role, content}` "
        "(which needs `chat_template: model`). In every `*_key` a dot reads a nested field "
        "(`reward_model.ground_truth`, as in verl's parquet) unless a column has the dotted name itself.",
    )
    answer_key: str = Field(
        default="answer",
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        description="Column holding the ground truth the rewards compare with (a string or a number, "
        "read as text; never empty).",
    )
    data_source_key: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        description="Column naming each row's data source (rewards and metrics are per source); unset: "
        "the file's name without extension (with a generator: its `data_source` column).",
    )
    extra_info_key: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        description="Column of a dict passed to reward functions as `extra_info`; unset: an empty dict.",
    )
    chosen_key: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        description="DPO with files: column of the preferred response (with `rejected_key`). The "
        "`addition` generator makes its own pairs.",
    )
    rejected_key: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        description="DPO with files: column of the dispreferred response (with `chosen_key`).",
    )
    demonstration_key: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        description="Agent jobs: column of a demonstration, the chat messages that follow the prompt (`{role, "
        "content}` with role `assistant`, `tool` or `user`, ending with an `assistant` turn), which `warmup` "
        "trains on (the assistant turns only) instead of the answer. With a generator: the column its "
        "`tool_demonstrations` are written to (default `demonstration`).",
    )
    system_prompt: str | None = Field(
        default=None,
        min_length=1,
        max_length=65536,
        description="Prepended to every prompt: as a system message with a chat template; with "
        "`chat_template: none` as plain text, exactly as given (end it with the separator you want).",
    )
    chat_template: Literal["model", "none"] = Field(
        default="model",
        description="`model`: the prompt is rendered with the tokenizer's chat template (with the "
        "generation prompt; the tokenizer must have one). `none`: the prompt string is the model's "
        "input as is, after BOS (for base models and the tiny demo).",
    )
    shuffle_seed: int | None = Field(
        default=None, ge=0, description="Seed of the order prompts are drawn in; unset: the job's `seed`."
    )
    generator: GeneratorSpec | None = Field(
        default=None,
        description="Generate the train (and validation) files instead of reading `train_files`.",
    )


def demo_data() -> DataSpec:
    """The data of a job that leaves `data` out: the tiny demo's addition prompts."""
    return DataSpec(generator=GeneratorSpec(name="addition"), chat_template="none")


def problems(cfg: JobConfig) -> list[Problem]:
    return [*_data_problems(cfg), *_demonstration_problems(cfg)]


def _data_problems(cfg: JobConfig) -> list[Problem]:
    """Where the prompts come from: files or a generator, never both or neither."""
    data = cfg.data
    problems: list[Problem] = []
    if (data.generator is None) == (not data.train_files):
        problems.append(
            Problem(
                "data.train_files",
                "set exactly one of data.train_files and data.generator: "
                + ("both are set" if data.train_files else "neither is set"),
            )
        )
    if data.generator is not None and data.val_files:
        problems.append(
            Problem(
                "data.val_files",
                "with data.generator the validation rows are generated (data.generator.num_val_prompts); "
                "leave data.val_files empty or read both splits from files",
            )
        )
    if (data.chosen_key is None) != (data.rejected_key is None):
        problems.append(
            Problem(
                "data.chosen_key" if data.chosen_key is None else "data.rejected_key",
                "preference pairs need both data.chosen_key and data.rejected_key",
            )
        )
    if cfg.algorithm.name == "dpo":
        addition = data.generator is not None and data.generator.name == "addition"
        if not addition and data.chosen_key is None:
            problems.append(
                Problem(
                    "data.chosen_key",
                    "dpo trains on preference pairs: use data.generator addition (which makes them) or "
                    "set data.chosen_key and data.rejected_key to the columns of the chosen and rejected responses",
                )
            )
    return problems


# DAPO (arXiv 2503.14476), sec. 2.3, "Removing KL Divergence".


def _demonstration_problems(cfg: JobConfig) -> list[Problem]:
    """Tool-use demonstrations (data.demonstration_key, a generator's tool_demonstrations) are trained by
    the warm-up after prompts rendered with the agent's tools, and a generator writes them to the column
    data.demonstration_key names (default `demonstration`), so the two settings go together."""
    data, generator = cfg.data, cfg.data.generator
    tool = generator.tool_demonstrations if generator is not None else None
    problems: list[Problem] = []
    if generator is not None and tool is None and data.demonstration_key is not None:
        problems.append(
            Problem(
                "data.demonstration_key",
                f"the {generator.name} generator writes demonstrations only with data.generator.tool_demonstrations; "
                "set that (python or calculator) or leave data.demonstration_key unset",
            )
        )
    if cfg.agent is None and (tool is not None or data.demonstration_key is not None):
        problems.append(
            Problem(
                "data.generator.tool_demonstrations" if tool is not None else "data.demonstration_key",
                "demonstrations show the model calling tools, which only a job with an agent section renders and "
                "runs; add agent (with agent.tools) or drop the demonstrations",
            )
        )
    if cfg.agent is not None and tool is not None and tool not in {spec.name for spec in cfg.agent.tools}:
        problems.append(
            Problem(
                "data.generator.tool_demonstrations",
                f"the demonstrations call the {tool} tool, which agent.tools does not list; add {{name: {tool}}} "
                "to agent.tools or demonstrate a tool the job has",
            )
        )
    return problems
