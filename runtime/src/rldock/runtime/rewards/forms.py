"""The two forms a user's reward function may have, told apart by its signature: verl's and TRL's.

- verl's `compute_score(data_source, solution_str, ground_truth, extra_info) -> float | dict`, called
  once per sample (rewards/terms.py's `per_sample`);
- TRL's batch form `f(prompts, completions, **kwargs) -> list[float | None]`, called once per batch
  with keyword lists, as TRL's GRPOTrainer calls its `reward_funcs`: `prompts` (each row's prompt as
  stored: text, or chat messages), `completions` (the decoded responses; for chat-message prompts
  each is `[{"role": "assistant", "content": text}]`, TRL's conversational form), `completion_ids`
  (each response's token ids, where the caller has them) and every other column of the data row
  under its own name (`answer`, `reward_model`, ...). A `None` counts 0 in the sum, as TRL's nansum
  counts it. TRL's `trainer_state` is not passed. A function without `**kwargs` gets the keywords
  it names only.

A function that names `completions` is TRL's; else one that takes the four positional arguments is
verl's (verl's own `default_compute_score` has `**kwargs` too); else one with `**kwargs` is TRL's
(`def f(**kwargs)`). Anything else fits neither and is refused where it is loaded, naming both forms.
`rldock validate` makes the same decision on a signature read from the file's source
(`signature_of`), so a wrong signature stops it before anything starts.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from rldock.runtime.rewards.terms import BatchRewardFn, RewardBatch, RewardError, RewardValue, per_sample

Parameter = inspect.Parameter
NAMED = (Parameter.POSITIONAL_OR_KEYWORD, Parameter.KEYWORD_ONLY)

EXPECTED_FORMS = (
    "verl's fn(data_source, solution_str, ground_truth, extra_info) -> float | dict, called per sample, "
    "or TRL's fn(prompts, completions, **kwargs) -> list[float | None], called per batch with every "
    "data column as a keyword list (docs/rewards.md)"
)


def _binds(signature: inspect.Signature, *args: Any, **kwargs: Any) -> bool:
    try:
        signature.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def _required_positional_only(signature: inspect.Signature) -> bool:
    return any(
        p.kind is Parameter.POSITIONAL_ONLY and p.default is Parameter.empty for p in signature.parameters.values()
    )


class TrlForm:
    """TRL's batch form: one call per batch with keyword lists, one float (or None) per completion back."""

    name: ClassVar[str] = "trl"

    def __init__(self, fn: Callable, signature: inspect.Signature):
        self.fn = fn
        parameters = signature.parameters.values()
        self.takes_all = any(p.kind is Parameter.VAR_KEYWORD for p in parameters)
        self.named = {p.name for p in parameters if p.kind in NAMED}
        self.required = {p.name for p in parameters if p.kind in NAMED and p.default is Parameter.empty}

    @staticmethod
    def accepts(signature: inspect.Signature) -> bool:
        if _required_positional_only(signature):
            return False
        parameters = signature.parameters.values()
        names_completions = any(p.name == "completions" and p.kind in NAMED for p in parameters)
        takes_all = any(p.kind is Parameter.VAR_KEYWORD for p in parameters)
        return names_completions or (takes_all and not VerlForm.accepts(signature))

    @property
    def _name(self) -> str:
        return getattr(self.fn, "__qualname__", repr(self.fn))

    def keywords(self, batch: RewardBatch) -> dict[str, list]:
        """What TRL would pass for `batch`, less what the function does not take."""
        prompts = batch.prompts if batch.prompts is not None else [None] * len(batch)
        completions = [
            [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text
            for prompt, text in zip(prompts, batch.solution_strs)
        ]
        given = {**batch.columns, "prompts": prompts, "completions": completions}
        if batch.completion_ids is not None:
            given["completion_ids"] = batch.completion_ids
        return given if self.takes_all else {key: value for key, value in given.items() if key in self.named}

    def __call__(self, batch: RewardBatch) -> list[RewardValue | Exception]:
        keywords = self.keywords(batch)
        missing = self.required - keywords.keys()
        if missing:  # the data, not one sample: it fails whatever reward.on_error says
            raise RewardError(
                f"{self._name} has TRL's form and takes {sorted(missing)}, which the data rows have no "
                f"column of (they have: {sorted(batch.columns)}); name a column, or take **kwargs"
            )
        try:
            values = self.fn(**keywords)
        except Exception as error:  # broad on purpose: user functions may raise anything; on_error decides
            return [error] * len(batch)
        if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
            raise RewardError(
                f"{self._name} has TRL's form and returned "
                f"{type(values).__name__} {values!r:.100}; it must return a list with one float (or None) "
                "per completion"
            )
        return [0.0 if value is None else value for value in values]


class VerlForm:
    """verl's per-sample form: fn(data_source, solution_str, ground_truth, extra_info)."""

    name: ClassVar[str] = "verl"

    @staticmethod
    def accepts(signature: inspect.Signature) -> bool:
        return _binds(signature, "data_source", "solution_str", "ground_truth", {})


FORMS: tuple[type[TrlForm] | type[VerlForm], ...] = (TrlForm, VerlForm)  # TRL first: see the module docstring


def form_of(signature: inspect.Signature) -> type[TrlForm] | type[VerlForm] | None:
    """The form a function with `signature` has, or None when it fits neither."""
    return next((form for form in FORMS if form.accepts(signature)), None)


def form_problem(signature: inspect.Signature) -> str | None:
    """Why a function with `signature` cannot be a reward function (to follow its name), or None.
    The one check of `rldock validate` (on the source) and of the reward worker (on the object)."""
    if form_of(signature) is not None:
        return None
    return f"takes {signature}, which fits neither reward form: {EXPECTED_FORMS}"


def batch_function(fn: Callable, *, field: str, reference: str) -> BatchRewardFn:
    """`fn` as a batch function, through the adapter of its form; RewardError naming `field` when it
    has neither form."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as error:  # a builtin without a signature, say
        raise RewardError(f"{field}: {reference} has no signature to read ({error}); {EXPECTED_FORMS}") from None
    problem = form_problem(signature)
    if problem is not None:
        raise RewardError(f"{field}: {reference} {problem}")
    if form_of(signature) is TrlForm:
        return TrlForm(fn, signature)
    return per_sample(fn)


class _Given:
    """The default of a parameter that has one, in a signature read from source."""

    def __repr__(self) -> str:
        return "..."


_GIVEN = _Given()


def signature_of(definition: ast.FunctionDef | ast.AsyncFunctionDef) -> inspect.Signature:
    """The signature a `def` in a file's source gives its function (defaults stand-ins: only
    whether a parameter has one matters to `form_of`)."""
    args = definition.args
    positional = [*args.posonlyargs, *args.args]
    first_default = len(positional) - len(args.defaults)
    parameters = [
        Parameter(
            arg.arg,
            Parameter.POSITIONAL_ONLY if index < len(args.posonlyargs) else Parameter.POSITIONAL_OR_KEYWORD,
            default=_GIVEN if index >= first_default else Parameter.empty,
        )
        for index, arg in enumerate(positional)
    ]
    if args.vararg is not None:
        parameters.append(Parameter(args.vararg.arg, Parameter.VAR_POSITIONAL))
    parameters += [
        Parameter(arg.arg, Parameter.KEYWORD_ONLY, default=Parameter.empty if default is None else _GIVEN)
        for arg, default in zip(args.kwonlyargs, args.kw_defaults)
    ]
    if args.kwarg is not None:
        parameters.append(Parameter(args.kwarg.arg, Parameter.VAR_KEYWORD))
    return inspect.Signature(parameters)
