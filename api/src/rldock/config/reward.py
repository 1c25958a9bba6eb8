"""`reward`: each response's reward, the weighted sum of its terms' scores (docs/rewards.md): the terms,
their options by name, and the checks that each term's options suit its name (`problems`,
rldock.config.problems.SECTION_CHECKS)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Literal
from urllib.parse import urlsplit

from pydantic import Field

from rldock.config.problem import Problem
from rldock.config.section import MAX_NAME_LENGTH, MAX_PATH_LENGTH, PATH, Spec

if TYPE_CHECKING:
    from rldock.config.job import JobConfig

# Defaults of the `remote` term's optional fields, applied by the runtime when a field is unset
# (per-name fields stay unset on other terms, so `reward_problems` can refuse them there).
REMOTE_TIMEOUT_S = 60.0
REMOTE_MAX_RETRIES = 3


class RewardTermSpec(Spec):
    """One reward term: a registered reward, its weight, and the options of its name (docs/rewards.md)."""

    # One flat model rather than a union per name: the RLJob CRD needs a structural schema (no
    # oneOf), and a flat model lists every option in one table of the reference.
    name: Literal[
        "math_verify", "exact_match", "digit_match", "format", "function", "remote", "model", "environment"
    ] = Field(
        description="`math_verify`: 1 if the response's final answer (after the last `####`, in "
        "`\\boxed{}`, else the last number) equals the ground truth by math-verify; `exact_match`: 1 for "
        "the exact answer; `digit_match`: partial credit for digits in place; `format`: 1 if the "
        "response matches `pattern`; `function`: your Python function; `remote`: an HTTP scoring service; "
        "`model`: a learned reward model (a sequence classifier at `path`) run as its own worker; "
        "`environment`: the rewards the episode's environment answered its steps with (agent.environment), "
        "aggregated as `aggregate` says.",
    )
    weight: float = Field(
        default=1.0,
        ge=-1000,
        le=1000,
        description="Factor of this term in the reward, which is the sum of weight * score over the "
        "terms; negative for a penalty.",
    )
    pattern: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_PATH_LENGTH,
        description="`format` only: a Python regex the whole response (surrounding whitespace "
        'removed) must match (`re.fullmatch`, `.` also matches newlines); write `.*x.*` for "contains x".',
    )
    function: Annotated[str | None, PATH] = Field(
        default=None,
        min_length=3,
        max_length=MAX_PATH_LENGTH,
        description="`function` only: `path/to/file.py:name` or `package.module:name`, a function "
        "`(data_source, solution_str, ground_truth, extra_info) -> float | dict` run in the reward "
        "worker; a relative file path is relative to the working directory of `rldock train`.",
    )
    url: str | None = Field(
        default=None,
        min_length=8,
        max_length=MAX_PATH_LENGTH,
        description="`remote` only: the http(s) URL that batches of samples are POSTed to as JSON "
        "(wire format in docs/rewards.md).",
    )
    timeout_s: float | None = Field(
        default=None,
        gt=0,
        le=3600,
        description=f"`remote` only: seconds to wait for one response; unset: {REMOTE_TIMEOUT_S:g}.",
    )
    max_retries: int | None = Field(
        default=None,
        ge=0,
        le=10,
        description="`remote` only: retries of a request after a connection error, a timeout or a "
        f"5xx/429 status, with exponential backoff; unset: {REMOTE_MAX_RETRIES}.",
    )
    token_env: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="`remote` only: name of an environment variable holding a bearer token sent as "
        "`Authorization: Bearer <token>` (in an RLJob, set it from a Secret with `env`); with it, `url` "
        "must be https:// unless `allow_insecure` is true.",
    )
    allow_insecure: bool | None = Field(
        default=None,
        description="`remote` only: true lets a term with `token_env` send its token over a plain http:// "
        "`url`, readable by anyone on the network path; for a service on the pod's own loopback "
        "(`http://127.0.0.1:...`, a sidecar) or inside a mesh that encrypts traffic between pods. Unset: "
        "false, an http:// URL with a token is refused.",
    )
    batch_size: int | None = Field(
        default=None,
        ge=1,
        le=65536,
        description="`remote` only: samples per request; unset: all samples the reward worker "
        "scores at once (training.micro_batch_size).",
    )
    path: Annotated[str | None, PATH] = Field(
        default=None,
        min_length=1,
        max_length=MAX_PATH_LENGTH,
        description="`model` only: a local Hugging Face folder holding a sequence-classification reward "
        "model with one label (AutoModelForSequenceClassification, num_labels 1) and its tokenizer "
        "(tokenizer.json); the score is its logit at the last token of prompt text + response text.",
    )

    aggregate: Literal["sum", "last"] | None = Field(
        default=None,
        description="`environment` only: the score of an episode from its environment's per-step rewards: `sum` "
        "of every step's, or the `last` step's (a step that answered no reward counts 0). Unset: sum.",
    )

    @property
    def sends_token_in_clear(self) -> bool:
        """True for a `remote` term that would send its bearer token over plain http:// without
        `allow_insecure` (refused by `reward_problems`, and again by the runtime's client)."""
        return (
            self.token_env is not None
            and self.url is not None
            and not self.allow_insecure
            and self.url.lower().startswith("http://")
        )


class RewardSpec(Spec):
    """The reward of each response: the weighted sum of its terms' scores."""

    terms: list[RewardTermSpec] = Field(
        default_factory=lambda: [RewardTermSpec(name="digit_match")],
        min_length=1,
        max_length=32,
        description="Reward terms; each response's reward is the sum of weight * score over them. "
        "Default: one `digit_match` term, and leaving the `reward` section out is allowed only with "
        "`model.builder` (a model of your own needs its reward named).",
    )
    on_error: Literal["fail", "zero"] = Field(
        default="fail",
        description="When a term raises on a sample (a gold answer math-verify cannot parse, a "
        "function's exception, a remote service down after its retries): `fail` stops the job naming "
        "the term and the sample's data source; `zero` scores that term 0 for that sample, counts it "
        "in the `reward/errors` metric and logs one warning per batch.",
    )

    @property
    def model_term_index(self) -> int | None:
        """Index of the `model` term (at most one, `reward_problems`), or None without one."""
        return next((index for index, term in enumerate(self.terms) if term.name == "model"), None)


# The options each reward term name takes, required ones first; every other option must stay unset
# on that term. (The reward-model term `model` will require `path`.)
TERM_OPTIONS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "math_verify": ((), ()),
    "exact_match": ((), ()),
    "digit_match": ((), ()),
    "format": (("pattern",), ()),
    "function": (("function",), ()),
    "remote": (("url",), ("timeout_s", "max_retries", "token_env", "allow_insecure", "batch_size")),
    "model": (("path",), ()),
    "environment": ((), ("aggregate",)),
}
_OPTION_HELP = {
    "pattern": "a Python regex the whole response must match",
    "function": "`path/to/file.py:function` or `package.module:function`",
    "url": "the http(s) URL of the scoring service",
    "path": "a local Hugging Face folder with a one-label sequence-classification model and its tokenizer",
}
# `file.py:fn` (any path ending in .py) or `package.module:fn`.
FUNCTION_REFERENCE = re.compile(
    r"^(?:(?P<file>.+\.py)|(?P<module>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)):(?P<attr>[A-Za-z_]\w*)$"
)


def reward_problems(reward: RewardSpec) -> list[Problem]:
    """Each term's options must suit its name: the required ones set, the others unset, the
    pattern, function reference and URL well formed, and a bearer token sent over https only
    (unless the term allows plain http)."""
    problems: list[Problem] = []
    options = {option for required, optional in TERM_OPTIONS.values() for option in required + optional}
    for index, term in enumerate(reward.terms):
        at = f"reward.terms[{index}]"
        required, optional = TERM_OPTIONS[term.name]
        for option in required:
            if getattr(term, option) is None:
                problems.append(
                    Problem(f"{at}.{option}", f"a `{term.name}` term needs {option}: {_OPTION_HELP[option]}")
                )
        for option in sorted(options - set(required) - set(optional)):
            if getattr(term, option) is not None:
                owner = next(name for name, (req, opt) in TERM_OPTIONS.items() if option in req + opt)
                problems.append(
                    Problem(
                        f"{at}.{option}",
                        f"only a `{owner}` term takes {option}; remove it from this `{term.name}` term",
                    )
                )
        problems.extend(_term_value_problems(term, at))
    models = [index for index, term in enumerate(reward.terms) if term.name == "model"]
    # One reward_model worker state writes one dock column (rm_score); a second model would need
    # a second state and column, and the device share of each.
    for index in models[1:]:
        problems.append(
            Problem(
                f"reward.terms[{index}].name",
                f"only one `model` term per job (reward.terms"
                f"[{models[0]}] is one already); score with one reward model, or combine "
                "several into one folder's classifier",
            )
        )
    return problems


def _term_value_problems(term: RewardTermSpec, at: str) -> list[Problem]:
    problems: list[Problem] = []
    if term.pattern is not None:
        try:
            re.compile(term.pattern)
        except re.error as error:
            problems.append(Problem(f"{at}.pattern", f"{term.pattern!r} is not a Python regex: {error}"))
    if term.function is not None and not FUNCTION_REFERENCE.match(term.function):
        problems.append(
            Problem(
                f"{at}.function",
                f"{term.function!r} is not `path/to/file.py:function` or `package.module:function` (one colon "
                "before a Python identifier)",
            )
        )
    if term.url is not None and not _is_http_url(term.url):
        problems.append(Problem(f"{at}.url", f"{term.url!r} is not an http:// or https:// URL with a host"))
    elif term.sends_token_in_clear:
        problems.append(
            Problem(
                f"{at}.url",
                f"{term.url!r} would send the bearer token of token_env {term.token_env} unencrypted, readable on "
                "the network path; use an https:// URL, or set allow_insecure: true on this term if the service "
                "is on the pod's own loopback or inside a mesh that encrypts traffic",
            )
        )
    return problems


def _is_http_url(url: str) -> bool:
    """An http or https URL with a host (and, if given, a numeric port)."""
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises ValueError for a port that is not a number in 0-65535
    except ValueError:  # e.g. an unclosed IPv6 bracket
        return False
    return parts.scheme.lower() in ("http", "https") and bool(parts.hostname)


def problems(cfg: JobConfig) -> list[Problem]:
    return reward_problems(cfg.reward)
