"""The CPU allocator policy of h3's CPU ranks: freed memory is kept for reuse, not handed back to the kernel.

Why. glibc serves a block above its mmap threshold (dynamic, at most 32 MiB) with a fresh `mmap` and
unmaps it on `free`. Every large activation of the sampling loop (a fused q|k|v, an attention output,
an MLP hidden state, an all-to-all's result) is such a block, so each one costs a page fault per 4 KiB
page every time it is created: measured on a 2-core VM, a fresh 352 MiB tensor costs ~250 ms of faults
on top of a 65 ms copy, and the narrow model at 1,388 tokens ran a denoising step in ~4.8 s instead
of ~2.2 s. The policy raises glibc's mmap threshold (`M_MMAP_THRESHOLD`, to `MMAP_THRESHOLD`) and its
trim threshold (`M_TRIM_THRESHOLD`), so those blocks come from the heap and stay there once freed: the
next step's activations reuse pages that are already mapped.

Cost, and honesty of memory figures. Between steps a rank's resident set stays at the step's peak
instead of falling back to the live tensors (the peak itself is unchanged: the memory is reused, not
added). `release()` (`malloc_trim(0)`) hands the retained memory back; `device.reset_peak_memory` calls
it, so every peak-memory window (text encoding, sampling) starts from the live memory, not from what an
earlier phase left cached.

Limit: glibc's per-thread cache (tcache) keeps small freed blocks marked in use, and one of them can
sit right after a freed large block (torch asks for 64-byte alignment, and the slack glibc splits
off is reused by the next small allocation); the same large size requested again in a tight loop
then may not fit the old block and the heap grows instead. In the sampling loop and the transport
the mix of sizes does reuse memory (30 steps of narrow-1k: resident set 863 -> 867 MiB; the
transport's steady state: no page faults). `GLIBC_TUNABLES=glibc.malloc.tcache_count=0` removes
the pinning, but tunables are read only when a process starts, so h3 does not set them.

Where it applies: CPU runs only, in every process that computes as a rank (the launching process at
world size 1 or under torchrun, and each spawned Gloo worker; see `h3core.runtime.world`). CUDA runs keep
glibc's defaults: their activations live in PyTorch's caching allocator already, and host memory there
mostly holds transient checkpoint reads that should go back to the system.

Switch: `H3_CPU_ALLOCATOR=system` keeps glibc's defaults (e.g. for the "before" arm of a benchmark);
`retain` (the default) applies the policy. On a C library without `mallopt` (musl, macOS) nothing is
changed and `policy()` says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import lru_cache

from h3core import settings

ALLOCATOR_ENV = settings.CPU_ALLOCATOR
RETAIN, SYSTEM = settings.CPU_ALLOCATOR_CHOICES

MMAP_THRESHOLD = 1 << 30
"""Blocks up to 1 GiB come from the heap (the largest activation of H3's real sequence on one rank,
its fused q|k|v in fp32, is ~1.3 GB: that one, alone, still uses mmap)."""

TRIM_THRESHOLD = 2**31 - 1
"""Free memory at the top of the heap is kept up to ~2 GiB (mallopt takes an int)."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # <malloc.h>

_applied: str | None = None  # what `apply` did in this process


def requested() -> str:
    """The policy `H3_CPU_ALLOCATOR` asks for (default `retain`); a bad value is a ConfigError."""
    return settings.cpu_allocator()


@lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    """glibc, when this process runs on it (the only C library whose `mallopt` we know)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 - attribute lookup fails on non-glibc C libraries
    except (OSError, AttributeError, TypeError):
        return None
    return libc


def apply() -> str:
    """Apply the requested policy to this process (idempotent); returns what is in force.

    `retain`, `system`, or `system (no glibc)` when the C library has no mallopt to call.
    """
    global _applied
    wanted = requested()
    if _applied is not None:
        return _applied
    libc = _libc()
    if wanted == SYSTEM:
        _applied = SYSTEM
    elif libc is None:
        _applied = f"{SYSTEM} (no glibc)"
    elif libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD):
        _applied = RETAIN
    else:
        _applied = f"{SYSTEM} (mallopt refused)"
    return _applied


def policy() -> str:
    """The policy in force in this process (`system` until `apply` ran)."""
    return _applied or SYSTEM


def release() -> None:
    """Hand the memory the allocator retains back to the kernel (`malloc_trim(0)`); a no-op off glibc."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
