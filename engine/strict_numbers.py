"""Number fields that refuse true / false.

pydantic reads a boolean as 1 or 0 for an int or float field, so a recipe's `max_tokens: true` or an
input line's `"temperature": false` would run with a value nobody wrote; so would an item of a
list of numbers (`pp_layers: [true, true]`). Every settings model
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
        if field is None or not takes_numbers_not_booleans(field.annotation):
            return value
        if isinstance(value, bool):
            raise ValueError(f"a number is needed, not {str(value).lower()}")
        if isinstance(value, (list, tuple)):          # a list of numbers (pp_layers, owners)
            for index, item in enumerate(value):
                if isinstance(item, bool):
                    raise ValueError(f"a list of numbers is needed; item {index} is "
                                     f"{str(item).lower()}")
        return value
