"""The registry of checks `h3 verify` runs, by name, in run order (see `spec.CHECK_NAMES`)."""

from __future__ import annotations

from h3core.verify import end_to_end, layers, nvfp4_layout, transport
from h3core.verify.session import Check, at_each_count
from h3core.verify.spec import CHECK_NAMES

CHECKS: dict[str, Check] = {
    check.name: check
    for check in (
        Check(
            "transport", "Ulysses seq->head->seq on fused q|k|v, ragged heads and tokens: bitwise identity",
            transport.TRANSPORT_VARIANTS, at_each_count(transport.measure_transport),
        ),
        Check(
            "sdpa", "Ulysses attention (all-to-all + SDPA on local heads) vs SDPA on one rank",
            layers.SDPA_VARIANTS, at_each_count(layers.measure_sdpa),
        ),
        Check(
            "ragged", "ragged gather_rows and reduce_scatter_rows (ranks with one row, or none) vs one process: bitwise",
            transport.RAGGED_VARIANTS, at_each_count(transport.measure_ragged),
        ),
        Check(
            "projection", "final layer on each rank's rows, gathered, vs the whole sequence",
            layers.PROJECTION_VARIANTS, at_each_count(layers.measure_projection),
        ),
        Check(
            "tp", "tensor-parallel attention and MLP (NVFP4 shards, gather + reduce-scatter) vs the unsharded blocks",
            layers.TP_VARIANTS, at_each_count(layers.measure_tp),
        ),
        Check(
            "nvfp4", "column- and row-parallel NVFP4 shards (memory and disk) are byte slices of the full tensors",
            nvfp4_layout.NVFP4_VARIANTS, at_each_count(nvfp4_layout.measure_nvfp4),
        ),
        Check(
            "parity", "end-to-end latents of both modes at each count vs one rank; both modes at one rank bitwise",
            end_to_end.PARITY_VARIANTS, end_to_end.run_parity,
        ),
        Check(
            "backends", "each other attention backend vs sdpa: attention output and one-rank latents",
            (), end_to_end.run_backends,
        ),
    )
}

assert tuple(CHECKS) == CHECK_NAMES, "the registry and CHECK_NAMES must list the same checks in the same order"
