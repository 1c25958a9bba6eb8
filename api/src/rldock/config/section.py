"""The base of every config section (rldock.config.job composes them into JobConfig; a section with a
module of its own, such as rldock.config.rollout_correction, builds on the same base)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Spec(BaseModel):
    """Base of every config section: unknown fields are errors, never silently ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
