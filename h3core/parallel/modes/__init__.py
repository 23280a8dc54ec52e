"""The distributed modes: one object per mode in one registry (`registry`), the built-in ones
registering themselves: `ulysses` (sequence parallel) and `tensor` (NVFP4 tensor parallel)."""

from h3core.parallel.modes import ulysses  # noqa: F401, I001 - registers the built-in modes, in this order
from h3core.parallel.modes import tensor  # noqa: F401
from h3core.parallel.modes.registry import Mode, ModeIncomplete, ParallelMode, mode_of, register, unregister

__all__ = ["Mode", "ModeIncomplete", "ParallelMode", "mode_of", "register", "unregister"]
