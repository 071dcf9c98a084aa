"""Number fields that refuse true / false.

pydantic reads a boolean as 1 or 0 for an int or float field, so a recipe's `max_tokens: true` or an
input line's `"temperature": false` would run with a value nobody wrote. Every settings model
(recipe sections, strategy parameters, sampling parameters) derives from NumbersNotBooleans.
"""
from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel, ValidationInfo, field_validator


def _leaves(annotation) -> set:
    args = get_args(annotation)
    if not args:
        return {annotation}
    return set().union(*(_leaves(a) for a in args))


def takes_numbers_not_booleans(annotation) -> bool:
    leaves = _leaves(annotation)
    return bool(leaves & {int, float}) and bool not in leaves


class NumbersNotBooleans(BaseModel):
    @field_validator("*", mode="before")
    @classmethod
    def _not_a_boolean(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if (isinstance(value, bool) and field is not None
                and takes_numbers_not_booleans(field.annotation)):
            raise ValueError(f"a number is needed, not {str(value).lower()}")
        return value
