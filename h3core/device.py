"""Device policy: which device and dtype a rank computes on, and what the machine has."""

from __future__ import annotations


def visible_gpu_count() -> int:
    """CUDA devices this process can see (0 without CUDA); imports torch lazily."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
