"""What every config section shares: refusal of unknown keys, immutability, strict integers, finite
floats."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

# Strict so that YAML `true` or "2" is not silently read as an int.
PositiveInt = Annotated[int, Field(strict=True, gt=0)]
NonNegativeInt = Annotated[int, Field(strict=True, ge=0)]


class ConfigSection(BaseModel):
    """Base for every config: unknown keys are errors, values never change after validation, and
    no float setting is ``inf`` or ``nan`` (``train.lr=inf`` would train NaN steps)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True,
                              allow_inf_nan=False)


def refuse_former_keys(data: Any, section: str, former: Mapping[str, str]) -> Any:
    """``data`` (a section's raw mapping, before validation) unless it holds one of ``former``'s
    keys, settings that moved or went away: such a key is refused in one line,
    ``{section}.{key} {why}``, ``why`` saying where its meaning went."""
    if isinstance(data, Mapping):
        for key, why in former.items():
            if key in data:
                raise ValueError(f"{section}.{key} {why}")
    return data
