"""Whether torchrun (or any launcher following its environment contract) started this process, the one
definition (`torchrun_env`), and the rank count a run takes from it (`world_size`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from h3core.errors import ConfigError
from h3core.settings.environment import WORLD_SIZE, env_int, env_str

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"


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
