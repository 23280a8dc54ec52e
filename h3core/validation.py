"""Requests built from what a user typed: every invalid value is one `ConfigError` line naming its flag.

A command turns its flags into a pydantic model (`GenerateRequest`, `TransportBenchConfig`,
`VerifyConfig`, `CreateOptions`, ...). Those models derive from `UserRequest`, whose constructor
turns pydantic's `ValidationError` into `ConfigError("--steps 0: must be at least 1")`: exit 2 and
one line, never a traceback. A model maps its field names to flags in `FLAGS` (default:
`--field-name`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ValidationError

from h3core.errors import ConfigError


class UserRequest(BaseModel):
    """A pydantic model filled from user input; see the module docstring."""

    FLAGS: ClassVar[dict[str, str]] = {}

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as err:
            raise ConfigError(describe(err, type(self).FLAGS)) from None


def describe(err: ValidationError, flags: dict[str, str]) -> str:
    """The first problem of `err` as '<flag> <value>: <what is wrong>' (and how many more there are)."""
    problems = err.errors()
    first = problems[0]
    field = str(first["loc"][0]) if first["loc"] else ""
    flag = flags.get(field, "--" + field.replace("_", "-")) if field else "the request"
    value = first.get("input")
    shown = f" {value!r}" if first["type"] != "missing" and not isinstance(value, dict) else ""
    more = f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})" if len(problems) > 1 else ""
    return f"{flag}{shown}: {_reason(first)}{more}"


def _reason(problem: Any) -> str:
    ctx = problem.get("ctx") or {}
    kind = problem["type"]
    bounds = {
        "greater_than_equal": ("must be at least", "ge"),
        "greater_than": ("must be greater than", "gt"),
        "less_than_equal": ("must be at most", "le"),
        "less_than": ("must be less than", "lt"),
    }
    if kind in bounds:
        words, key = bounds[kind]
        return f"{words} {ctx.get(key)}"
    if kind == "finite_number":
        return "must be a finite number (not inf or nan)"
    if kind == "missing":
        return "is required"
    if kind == "extra_forbidden":
        return "is not a setting this command takes"
    message = str(problem.get("msg", "is not valid"))
    return message[0].lower() + message[1:] if message else "is not valid"
