"""Requests built from flags: `UserRequest`, the pydantic base of every command's request model, whose
constructor turns pydantic's `ValidationError` into `ConfigError("--steps 0: must be at least 1")`,
and `SizeFlags`, the size flags of a command that plans a video without running it.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, Field, ValidationError

from h3core.errors import ConfigError


class UserRequest(BaseModel):
    """A pydantic model filled from user input: an invalid value is one `ConfigError` line naming its
    flag. A model maps its field names to flags in `FLAGS` (default: `--field-name`)."""

    FLAGS: ClassVar[dict[str, str]] = {}

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as err:
            raise ConfigError(describe(err, type(self).FLAGS)) from None


class SizeFlags(UserRequest):
    """`--width/--height/--frames` of a command that plans a video without running it (`h3 plan`,
    `h3 bench-transport`), checked as `h3 generate` checks them: None is the preset's size, a
    given value is at least 1 (0 is refused, never taken for "not given")."""

    width: int | None = Field(None, ge=1, description="Pixels (None: the preset's).")
    height: int | None = Field(None, ge=1, description="Pixels (None: the preset's).")
    frames: int | None = Field(None, ge=1, description="Video frames, 4k+1 (None: the preset's).")

    def or_defaults(self, width: int, height: int, frames: int) -> tuple[int, int, int]:
        """(width, height, frames): each given value, else the default passed for it."""
        return (width if self.width is None else self.width, height if self.height is None else self.height,
                frames if self.frames is None else self.frames)


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


_BOUNDS = {
    "greater_than_equal": ("must be at least", "ge"),
    "greater_than": ("must be greater than", "gt"),
    "less_than_equal": ("must be at most", "le"),
    "less_than": ("must be less than", "lt"),
}
_REASONS = {
    "finite_number": "must be a finite number (not inf or nan)",
    "missing": "is required",
    "extra_forbidden": "is not a setting this command takes",
}


def _reason(problem: Any) -> str:
    kind = problem["type"]
    if kind in _BOUNDS:
        words, key = _BOUNDS[kind]
        return f"{words} {(problem.get('ctx') or {}).get(key)}"
    if kind in _REASONS:
        return _REASONS[kind]
    message = str(problem.get("msg", "is not valid"))
    return message[0].lower() + message[1:] if message else "is not valid"
