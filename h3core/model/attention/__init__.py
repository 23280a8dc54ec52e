"""Attention backends, in three modules, each named for what it is:

- `dispatch`   the one interface processors call (`AttentionKernel`, `attend`: diffusers'
               `dispatch_attention_fn`), the backends behind it (`sdpa`, `math`, `sage2`, `flash`)
               and the record of the kernels that really ran;
- `sdpa_rule`  h3's rule table: which fused SDPA kernels a CUDA call may take (`choose_sdpa_backends`,
               a pure function of torch, cuDNN, GPU, dtype, head width and length);
- `checks`     the pre-run checks (`check_backend`): refuse, before any rank starts, a backend that
               cannot run here, in one line.

The attention module itself (projections, norms, RoPE, the output projection) and its default
processor are the model's (`h3core.model.dit.Attention`, `AttentionProcessor`); a parallel mode
swaps the processor (`h3core.parallel.modes.ulysses.UlyssesProcessor`), never the model.
This package re-exports the names callers use.
"""

from h3core.model.attention.checks import check_backend
from h3core.model.attention.dispatch import (
    BACKENDS,
    KERNEL_NAMES,
    AttentionKernel,
    SdpaChoices,
    attend,
    is_math_kernel,
    planned_sdpa_kernel,
    scores_bytes,
    sdpa_kernel_of,
)
from h3core.model.attention.sdpa_rule import HALF_DTYPES, SdpaChoice, choose_sdpa_backends, sdpa_choice_for, sdpa_choice_here, torch_default_prefers_cudnn

__all__ = [
    "BACKENDS", "HALF_DTYPES", "KERNEL_NAMES", "AttentionKernel", "SdpaChoice", "SdpaChoices", "attend", "check_backend",
    "choose_sdpa_backends", "is_math_kernel", "planned_sdpa_kernel", "scores_bytes", "sdpa_choice_for", "sdpa_choice_here",
    "sdpa_kernel_of", "torch_default_prefers_cudnn",
]
