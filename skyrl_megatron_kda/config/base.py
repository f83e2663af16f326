"""What every config section shares: refusal of unknown keys, immutability, strict integers, finite
floats."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

# Strict so that YAML `true` or "2" is not silently read as an int.
PositiveInt = Annotated[int, Field(strict=True, gt=0)]
NonNegativeInt = Annotated[int, Field(strict=True, ge=0)]


class ConfigSection(BaseModel):
    """Base for every config: unknown keys are errors, values never change after validation, and
    no float setting is ``inf`` or ``nan`` (``train.lr=inf`` would train NaN steps)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True,
                              allow_inf_nan=False)
