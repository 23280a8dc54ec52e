"""h3's environment variables turned into checked values: every `H3_*` name (docs/cli.md's tables are the
contract), one reader per kind of value (`env_str`, `env_int`, `env_bool`, `env_seconds`), and one
function per setting, taking the flag's value when a command has the flag (`output_folder(flag)`,
`save_latents(flag)`, ...). The one way every setting is chosen: **a flag beats its variable; a
variable beats the default** (`choose`). A malformed value is one `ConfigError` line that names the
flag or the variable it came from.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Callable, Sequence, TypeVar

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
