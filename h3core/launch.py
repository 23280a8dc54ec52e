"""Launching ranks: how many, and (later in this module) spawning or joining them."""

from __future__ import annotations

from h3core.device import visible_gpu_count
from h3core.environment import world_size_from_env


def resolve_world_size(count: int | None) -> int:
    """The rank count of a run: the explicit count, else H3_WORLD_SIZE, else every visible GPU, else 1."""
    if count is not None:
        return count
    from_env = world_size_from_env()
    if from_env is not None:
        return from_env
    return visible_gpu_count() or 1
