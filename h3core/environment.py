"""The seed's environment variables, parsed and checked in one place.

Precedence everywhere: a flag beats its variable; a variable beats the default. A malformed value
is a `ConfigError` that names the variable.
"""

from __future__ import annotations

import os

from h3core.errors import ConfigError

WORLD_SIZE = "H3_WORLD_SIZE"
BENCHMARK = "H3_DISTRIBUTED_BENCHMARK"
OUTPUT = "H3_DISTRIBUTED_OUTPUT"
MODEL_PATH = "H3_MODEL_PATH"
TEXT_ENCODER_PATH = "H3_TEXT_ENCODER_PATH"
SAVE_LATENTS = "H3_SAVE_LATENTS"
GPU_COUNTS = "H3_GPU_COUNTS"
DISTRIBUTED_MODES = "H3_DISTRIBUTED_MODES"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def env_str(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


def env_int(name: str) -> int | None:
    value = env_str(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a whole number; set it to e.g. 8 or unset it") from None


def env_bool(name: str) -> bool | None:
    value = env_str(name)
    if value is None:
        return None
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ConfigError(f"{name}={value!r} is not a boolean; use 1 or 0")


def parse_int_list(text: str, what: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]; duplicates dropped, order kept; every value must be >= 1."""
    values: list[int] = []
    for part in text.replace(" ", ",").split(","):
        if not part:
            continue
        try:
            value = int(part)
        except ValueError:
            raise ConfigError(f"{what} {text!r} is not a comma-separated list of whole numbers, e.g. 1,2,4,8") from None
        if value < 1:
            raise ConfigError(f"{what} {text!r} holds {value}; counts start at 1")
        if value not in values:
            values.append(value)
    if not values:
        raise ConfigError(f"{what} is empty; give e.g. 1,2,4,8")
    return values


def parse_str_list(text: str) -> list[str]:
    return [p for p in text.replace(" ", ",").split(",") if p]


def world_size_from_env() -> int | None:
    """`H3_WORLD_SIZE`, the seed's fallback when no count is given (None when unset)."""
    value = env_int(WORLD_SIZE)
    if value is not None and value < 1:
        raise ConfigError(f"{WORLD_SIZE}={value} must be at least 1")
    return value
