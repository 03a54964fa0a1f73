"""The base of every config section: unknown keys, assignment without validation and inf / nan are refused; and the
upper bounds on sizes every section shares."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

# Upper bounds on sizes that no run means literally; larger values are typos that would otherwise fail as
# allocation errors deep inside the model. The memory a given size needs is checked again when the run is built.
MAX_IMAGE_SIZE, MAX_TOKENS, MAX_BATCH = 4096, 65536, 1 << 20
MAX_SEED = (1 << 32) - 1  # numpy's and Meta-World's seeds are 32-bit
MAX_ENV_SEED = 40_000  # eval / generation: base seed x 100,000 + offsets stays a 32-bit environment seed


class Section(BaseModel):
    # NOTE: allow_inf_nan=False: inf / nan (and 1e400, which TOML reads as inf) are refused in every float field
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
