"""Number fields that refuse true / false.

pydantic reads a boolean as 1 or 0 for an int or float field, so a recipe's `max_tokens: true` or an
input line's `"temperature": false` would run with a value nobody wrote; so would an item of a
list of numbers (`pp_layers: [true, true]`). Every settings model
(recipe sections, strategy parameters, sampling parameters) derives from NumbersNotBooleans.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, get_args, get_origin

from pydantic import BaseModel, ValidationInfo, field_validator


def _leaves(annotation) -> set:
    args = get_args(annotation)
    if not args:
        return {annotation}
    return set().union(*(_leaves(a) for a in args))


def takes_numbers_not_booleans(annotation) -> bool:
    leaves = _leaves(annotation)
    return bool(leaves & {int, float}) and bool not in leaves


def _takes_lists(annotation) -> bool:
    if get_origin(annotation) in (list, tuple):
        return True
    return any(_takes_lists(a) for a in get_args(annotation))


@lru_cache(maxsize=None)
def _number_field(cls: type, name: str) -> tuple[bool, bool]:
    """(a number field that refuses booleans, one that also takes a list of them), per model
    class and field: worked out once, not on every validation."""
    field = cls.model_fields.get(name)
    if field is None or not takes_numbers_not_booleans(field.annotation):
        return False, False
    return True, _takes_lists(field.annotation)


class NumbersNotBooleans(BaseModel):
    @field_validator("*", mode="before")
    @classmethod
    def _not_a_boolean(cls, value: Any, info: ValidationInfo) -> Any:
        number, listed = _number_field(cls, info.field_name or "")
        if not number:
            return value
        if isinstance(value, bool):
            raise ValueError(f"a number is needed, not {str(value).lower()}")
        if listed and isinstance(value, (list, tuple)):   # a list of numbers (pp_layers, owners)
            for index, item in enumerate(value):
                if isinstance(item, bool):
                    raise ValueError(f"a list of numbers is needed; item {index} is "
                                     f"{str(item).lower()}")
        return value
