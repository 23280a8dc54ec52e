"""The seed's environment variables, parsed and checked in one place.

Precedence everywhere: a flag beats its variable; a variable beats the default. A malformed value
is a `ConfigError` that names the variable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from h3core.errors import ConfigError

WORLD_SIZE = "H3_WORLD_SIZE"
BENCHMARK = "H3_DISTRIBUTED_BENCHMARK"
OUTPUT = "H3_DISTRIBUTED_OUTPUT"
MODEL_PATH = "H3_MODEL_PATH"
TEXT_ENCODER_PATH = "H3_TEXT_ENCODER_PATH"
SAVE_LATENTS = "H3_SAVE_LATENTS"
GPU_COUNTS = "H3_GPU_COUNTS"
DISTRIBUTED_MODES = "H3_DISTRIBUTED_MODES"
RANK_TIMEOUT = "H3_RANK_TIMEOUT"
COLLECTIVE_TIMEOUT = "H3_COLLECTIVE_TIMEOUT"

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
DEFAULT_RANK_TIMEOUT_S = 60.0
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0

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


def env_seconds(name: str, default: float) -> float:
    """A positive number of seconds from `name`, else `default`."""
    value = env_str(name)
    if value is None:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise ConfigError(f"{name}={value!r} is not a positive number of seconds; set it to e.g. 60 or unset it")
    return seconds


def rank_timeout_s() -> float:
    """`H3_RANK_TIMEOUT`: how long h3 waits for a rank that shows no sign of life (a stopped or
    frozen process) and for torchrun's ranks to meet, before it ends the run with one line."""
    return env_seconds(RANK_TIMEOUT, DEFAULT_RANK_TIMEOUT_S)


def collective_timeout_s() -> float:
    """`H3_COLLECTIVE_TIMEOUT`: the Gloo/NCCL timeout of one collective (a rank waiting for its peers)."""
    return env_seconds(COLLECTIVE_TIMEOUT, DEFAULT_COLLECTIVE_TIMEOUT_S)


# --- "launched by torchrun": the one definition --------------------------------------------------------


@dataclass(frozen=True)
class TorchrunEnv:
    """The launcher contract torchrun follows: this process is rank `rank` of `world_size`."""

    rank: int
    world_size: int
    local_rank: int

    def describe(self) -> str:
        master = f", MASTER_ADDR={os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}" if env_str("MASTER_ADDR") else ""
        return f"RANK={self.rank} WORLD_SIZE={self.world_size} LOCAL_RANK={self.local_rank}{master}"


def torchrun_env() -> TorchrunEnv | None:
    """This process's torchrun rank, when RANK, WORLD_SIZE and LOCAL_RANK are all set (else None).

    Every part of h3 that asks "was I launched by torchrun?" asks this: a stray `RANK` alone is not
    a launch. Values that cannot come from a launcher are a ConfigError that says to unset them.
    """
    values = {name: env_str(name) for name in TORCHRUN_VARS}
    if not all(values.values()):
        return None
    shown = " ".join(f"{k}={v}" for k, v in values.items())
    stale = "if torchrun did not start this command, unset RANK, WORLD_SIZE and LOCAL_RANK"
    try:
        rank, world_size, local_rank = (int(values[name]) for name in TORCHRUN_VARS)  # type: ignore[arg-type]
    except ValueError:
        raise ConfigError(f"{shown}: not whole numbers; {stale}") from None
    if world_size < 1 or not 0 <= rank < world_size or local_rank < 0:
        raise ConfigError(f"{shown}: not a valid torchrun rank (needs 0 <= RANK < WORLD_SIZE); {stale}")
    return TorchrunEnv(rank, world_size, local_rank)
