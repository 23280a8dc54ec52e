"""Settings: what a user gives h3 (flags and environment variables) turned into checked values.

This is the one module that reads h3's environment variables, and the one way every setting is
chosen: **a flag beats its variable; a variable beats the default** (`choose`). A malformed value
is one `ConfigError` line that names the flag or the variable it came from.

Two halves:

- variables: every `H3_*` name (README's tables are the contract), one reader per kind of value
  (`env_str`, `env_int`, `env_bool`, `env_seconds`), and one function per setting that takes the
  flag's value when a command has the flag (`output_folder(flag)`, `save_latents(flag)`, ...);
- requests: `UserRequest`, the pydantic base of every command's request model, whose constructor
  turns pydantic's `ValidationError` into `ConfigError("--steps 0: must be at least 1")`.

Torch-free and quick to import: the CLI checks flags before anything heavy starts.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Sequence, TypeVar

from pydantic import BaseModel, Field, ValidationError

from h3core.errors import ConfigError

T = TypeVar("T")

# --- the seed's variables (DESIGN.md §1) ---------------------------------------------------------------
WORLD_SIZE = "H3_WORLD_SIZE"
BENCHMARK = "H3_DISTRIBUTED_BENCHMARK"
OUTPUT = "H3_DISTRIBUTED_OUTPUT"
MODEL_PATH = "H3_MODEL_PATH"
TEXT_ENCODER_PATH = "H3_TEXT_ENCODER_PATH"
SAVE_LATENTS = "H3_SAVE_LATENTS"
GPU_COUNTS = "H3_GPU_COUNTS"
DISTRIBUTED_MODES = "H3_DISTRIBUTED_MODES"
# --- h3's own ----------------------------------------------------------------------------------------
VIDEO_VAE_PATH = "H3_VIDEO_VAE_PATH"
AUDIO_VAE_PATH = "H3_AUDIO_VAE_PATH"
CACHE_DIR = "H3_CACHE_DIR"
EMULATE_FP4 = "H3_EMULATE_FP4"
CPU_ALLOCATOR = "H3_CPU_ALLOCATOR"
RANK_TIMEOUT = "H3_RANK_TIMEOUT"
COLLECTIVE_TIMEOUT = "H3_COLLECTIVE_TIMEOUT"
MEMORY_CHECK = "H3_MEMORY_CHECK"
MAX_CPU_RANKS = "H3_MAX_CPU_RANKS"
INJECT_FAULT = "H3_INJECT_FAULT"
DEBUG = "H3_DEBUG"
API_KEY = "H3_API_KEY"

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"

DEFAULT_SEED = 440420
"""The seed of the seed's reference runs: the default of every `--seed`."""
DEFAULT_RANK_TIMEOUT_S = 60.0
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
DEFAULT_MAX_CPU_RANKS = 64
"""Gloo ranks one machine runs by default: 56 (H3's heads) with room; each is a process with its own torch."""
CPU_ALLOCATOR_CHOICES = ("retain", "system")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


# --- reading one variable ----------------------------------------------------------------------------


def env_str(name: str) -> str | None:
    """The variable's text, stripped; None when unset or empty."""
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
    return None if value is None else parse_bool(value, name)


@functools.lru_cache(maxsize=32)
def parse_bool(text: str, source: str) -> bool:
    """'1', 'true', 'yes', 'on' / '0', 'false', 'no', 'off' (any case); anything else names `source`."""
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{source}={text!r} is not a boolean; use 1 or 0, or unset it")


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


def parse_int_list(text: str, what: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]; duplicates dropped, order kept; every value must be >= 1."""
    values: list[int] = []
    for part in parse_str_list(text):
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


# --- flag > variable > default: the one way -----------------------------------------------------------


def choose(flag: T | None, variable: str, parse: Callable[[str, str], T], default: Callable[[], T]) -> T:
    """The flag's value when given; else the variable's text parsed (`parse(text, variable)`); else `default()`."""
    if flag is not None:
        return flag
    text = env_str(variable)
    return parse(text, variable) if text is not None else default()


def _path(text: str, source: str) -> Path:
    return Path(text)


def _none() -> None:
    return None


def output_folder(flag: Path | None) -> Path | None:
    """`--output`, else `H3_DISTRIBUTED_OUTPUT`, else None (the command's default folder)."""
    return choose(flag, OUTPUT, _path, _none)


def benchmark_path(flag: Path | None) -> Path | None:
    """`--benchmark`, else `H3_DISTRIBUTED_BENCHMARK`, else None (no second copy of the report)."""
    return choose(flag, BENCHMARK, _path, _none)


def save_latents(flag: bool | None) -> bool:
    """`--save-latents/--no-save-latents`, else `H3_SAVE_LATENTS` (0 = reports only), else save."""
    return choose(flag, SAVE_LATENTS, parse_bool, lambda: True)


def api_key(flag: str | None) -> str | None:
    """`h3 serve --api-key`, else `H3_API_KEY`, else None (no key: loopback only)."""
    return choose(flag, API_KEY, lambda text, source: text, _none)


def model_path(flag: Path | None) -> Path | None:
    """`--model`, else `H3_MODEL_PATH`, else None (the embedded synthetic checkpoint)."""
    return choose(flag, MODEL_PATH, _path, _none)


def text_encoder_path(flag: Path | None) -> Path | None:
    """`--text-encoder`, else `H3_TEXT_ENCODER_PATH`, else None (the synthetic text encoder)."""
    return choose(flag, TEXT_ENCODER_PATH, _path, _none)


def video_vae_path(flag: Path | None) -> Path | None:
    """`--video-vae`, else `H3_VIDEO_VAE_PATH`, else None (beside the transformer, else the synthetic VAE)."""
    return choose(flag, VIDEO_VAE_PATH, _path, _none)


def audio_vae_path(flag: Path | None) -> Path | None:
    """`--audio-vae`, else `H3_AUDIO_VAE_PATH`, else None (beside the transformer, else the synthetic VAE)."""
    return choose(flag, AUDIO_VAE_PATH, _path, _none)


def rank_counts(flag: str | None, default: Sequence[int]) -> list[int]:
    """Rank counts, ascending: `--counts`, else `H3_GPU_COUNTS`, else `default`."""
    if flag is not None:
        return sorted(parse_int_list(flag, "--counts"))
    return sorted(choose(None, GPU_COUNTS, parse_int_list, lambda: list(default)))


def mode_names(flag: str | None, choices: Sequence[str], default: Sequence[str]) -> list[str]:
    """Mode names in the given order, deduplicated: `--modes`, else `H3_DISTRIBUTED_MODES`, else `default`."""
    source, text = ("--modes", flag) if flag is not None else (DISTRIBUTED_MODES, env_str(DISTRIBUTED_MODES))
    if text is None:
        return list(default)
    names: list[str] = []
    for name in parse_str_list(text):
        if name.lower() not in choices:
            raise ConfigError(f"{source} {text!r} names an unknown mode {name!r}; choose from {', '.join(choices)}")
        if name.lower() not in names:
            names.append(name.lower())
    if not names:
        raise ConfigError(f"{source} is empty; give e.g. {', '.join(choices)}")
    return names


def world_size(count: int | None, visible_gpus: Callable[[], int]) -> int:
    """The rank count of a run: the explicit count, else torchrun's WORLD_SIZE when launched by it,
    else `H3_WORLD_SIZE`, else every visible GPU (`visible_gpus()`), else 1."""
    if count is not None:
        if count < 1:
            raise ConfigError(f"world size must be at least 1, got {count}: give a rank count of 1 or more")
        return count
    launched = torchrun_env()
    if launched is not None:
        return launched.world_size
    from_env = env_int(WORLD_SIZE)
    if from_env is not None:
        if from_env < 1:
            raise ConfigError(f"{WORLD_SIZE}={from_env} must be at least 1")
        return from_env
    return visible_gpus() or 1


# --- settings without a flag ---------------------------------------------------------------------------


def rank_timeout_s() -> float:
    """`H3_RANK_TIMEOUT`: how long h3 waits for a rank that shows no sign of life (a stopped or
    frozen process) and for torchrun's ranks to meet, before it ends the run with one line."""
    return env_seconds(RANK_TIMEOUT, DEFAULT_RANK_TIMEOUT_S)


def collective_timeout_s() -> float:
    """`H3_COLLECTIVE_TIMEOUT`: the Gloo/NCCL timeout of one collective (a rank waiting for its peers)."""
    return env_seconds(COLLECTIVE_TIMEOUT, DEFAULT_COLLECTIVE_TIMEOUT_S)


def debug() -> bool:
    """`H3_DEBUG`: anything but unset, empty or 0 shows tracebacks and the ranks' own output."""
    return os.environ.get(DEBUG, "") not in ("", "0")


def memory_check() -> bool:
    """`H3_MEMORY_CHECK=0` skips the memory check before a run (default: check)."""
    return env_bool(MEMORY_CHECK) is not False


def max_cpu_ranks() -> int:
    """`H3_MAX_CPU_RANKS`: the most Gloo ranks one machine starts (default 64; 0 or less: the default)."""
    value = env_int(MAX_CPU_RANKS)
    return value if value is not None and value > 0 else DEFAULT_MAX_CPU_RANKS


def cache_dir() -> Path:
    """Where synthetic checkpoints are cached: `H3_CACHE_DIR`, else ~/.cache/h3."""
    return choose(None, CACHE_DIR, _path, lambda: Path.home() / ".cache" / "h3")


def emulate_fp4() -> bool:
    """`H3_EMULATE_FP4`: CPU NVFP4 linears take the emulated fp4 path (unset: False). Read per
    forward (spawned ranks inherit it), so the parse is cached per text."""
    return parse_bool(os.environ.get(EMULATE_FP4, "").strip() or "0", EMULATE_FP4)


def result_settings() -> dict[str, object]:
    """Every variable that changes a run's numbers (not only its speed), with its value: a run's
    fingerprint holds them, so that a result computed under other settings is never taken for
    this one (`H3_CPU_ALLOCATOR`, timeouts, checks and faults change no number)."""
    return {EMULATE_FP4: emulate_fp4()}


def cpu_allocator() -> str:
    """`H3_CPU_ALLOCATOR`: `retain` (default) or `system` (see `h3core.runtime.cpu_memory`)."""
    value = (env_str(CPU_ALLOCATOR) or CPU_ALLOCATOR_CHOICES[0]).lower()
    if value not in CPU_ALLOCATOR_CHOICES:
        raise ConfigError(f"{CPU_ALLOCATOR}={value!r} is not a CPU allocator policy; use {' or '.join(CPU_ALLOCATOR_CHOICES)}")
    return value


def injected_faults() -> str:
    """`H3_INJECT_FAULT`'s text ('' when unset): see `h3core.runtime.faults`."""
    return os.environ.get(INJECT_FAULT, "")


# --- "launched by torchrun": the one definition --------------------------------------------------------


@dataclass(frozen=True)
class TorchrunEnv:
    """The launcher contract torchrun follows: this process is rank `rank` of `world_size`."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    """Processes torchrun started on this machine (`LOCAL_WORLD_SIZE`; the world when a launcher omits it).
    Multi-node: WORLD_SIZE counts every machine's ranks, this only this machine's."""

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
        rank, world, local_rank = (int(values[name]) for name in TORCHRUN_VARS)  # type: ignore[arg-type]
    except ValueError:
        raise ConfigError(f"{shown}: not whole numbers; {stale}") from None
    if world < 1 or not 0 <= rank < world or local_rank < 0:
        raise ConfigError(f"{shown}: not a valid torchrun rank (needs 0 <= RANK < WORLD_SIZE); {stale}")
    local_world = _local_world_size(world, local_rank, stale)
    return TorchrunEnv(rank, world, local_rank, local_world)


def _local_world_size(world: int, local_rank: int, stale: str) -> int:
    """`LOCAL_WORLD_SIZE` (torchrun sets it: the processes of this machine), else the whole world."""
    text = env_str(LOCAL_WORLD_SIZE)
    if text is None:
        return world
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{LOCAL_WORLD_SIZE}={text}: not a whole number; {stale}") from None
    if not local_rank < value <= world:
        raise ConfigError(f"{LOCAL_WORLD_SIZE}={value} with LOCAL_RANK={local_rank} and WORLD_SIZE={world}: not a valid torchrun launch; {stale}")
    return value


def ranks_on_this_machine(world_size: int) -> int:
    """The ranks of a `world_size` run that this machine holds: under torchrun its `LOCAL_WORLD_SIZE`
    (a multi-node world spans machines), else all of them (spawned here, or one in this process)."""
    launched = torchrun_env()
    return launched.local_world_size if launched is not None else world_size


def under_torchrun() -> bool:
    """True when torchrun (or any launcher following its environment contract) started us."""
    return torchrun_env() is not None


def is_rank_zero() -> bool:
    """False only in a torchrun-launched process whose rank is not 0 (a malformed launch environment
    counts as rank 0: the command refuses it, and that line must show)."""
    try:
        launched = torchrun_env()
    except ConfigError:
        return True
    return launched is None or launched.rank == 0


# --- requests built from flags -------------------------------------------------------------------------


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
