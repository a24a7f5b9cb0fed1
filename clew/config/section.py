"""The base of every configuration section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every config section: unknown keys and wrong types are errors, not coercions."""

    model_config = ConfigDict(extra="forbid", strict=True)
