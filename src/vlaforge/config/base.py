"""The base of every config section: unknown keys, assignment without validation and inf / nan are refused."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    # NOTE: allow_inf_nan=False: inf / nan (and 1e400, which TOML reads as inf) are refused in every float field
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
