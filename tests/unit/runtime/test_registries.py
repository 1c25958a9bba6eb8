"""Every config field that names an implementation accepts exactly its registry's entries, so a
name the schema accepts always resolves, and every implementation is reachable from a config."""

import types
from typing import Literal, Optional, Union, get_args, get_origin

import pytest
from pydantic import BaseModel

from rldock.config.job import JobConfig
from rldock.runtime.algorithms.filtration import FILTRATION_MODES
from rldock.runtime.algorithms.kl import KL_ESTIMATORS
from rldock.runtime.data import GENERATORS
from rldock.runtime.flow.catalogue import RECIPES
from rldock.runtime.models import MODEL_BUILDERS
from rldock.runtime.registry import Registry
from rldock.runtime.rewards import REWARDS

REGISTRIES = [GENERATORS, REWARDS, RECIPES, FILTRATION_MODES, KL_ESTIMATORS, MODEL_BUILDERS]


def _literal_names(model: type[BaseModel], dotted: str) -> set[str]:
    head, _, rest = dotted.partition(".")
    annotation = model.model_fields[head].annotation
    # Optional[Literal[...]] or `a section | None` (typing's Union or the | operator's UnionType)
    if get_origin(annotation) in (Optional, Union, types.UnionType):
        annotation = next(arg for arg in get_args(annotation) if arg is not type(None))
    if get_origin(annotation) is list:  # a list of sections, e.g. reward.terms
        (annotation,) = get_args(annotation)
    if rest:
        return _literal_names(annotation, rest)
    assert get_origin(annotation) is Literal, f"{dotted} is not a Literal of names"
    return set(get_args(annotation))


@pytest.mark.parametrize("registry", REGISTRIES, ids=lambda r: r.field)
def test_config_literal_equals_registry_keys(registry: Registry):
    assert _literal_names(JobConfig, registry.field) == set(registry)


def test_unknown_name_lists_the_valid_ones_and_the_field():
    with pytest.raises(ValueError, match=r"algorithm.kl_estimator 'k2' .* valid: \['k1', 'k3'\]"):
        KL_ESTIMATORS.get("k2")
