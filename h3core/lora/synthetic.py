"""Synthetic LoRA adapters in the real file layouts, for any model config (benchmarks, parity checks).

As the synthetic checkpoint does for the model (h3core.model.synthetic), `write_synthetic_adapter`
writes random matrices under the real key names of one format (h3core.lora.keys), at the shapes of
a config's linears: kohya/ComfyUI (`diffusion_model.blocks.N.attn.qkv_proj.lora_down.weight`,
`lora_up`, `alpha`) or diffusers/PEFT (`transformer.transformer_blocks.N.attn.to_q.lora_A.weight`
... with diffusers' `lora_adapter_metadata`). Metadata keys (e.g. a schedule, h3core.lora.schedule)
can be added. Every file says `h3_weights: synthetic` in its metadata.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from h3core.files.safetensors import write_safetensors
from h3core.model.config import ModelConfig

BLOCK_LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
_DIFFUSERS = {"attn.out_proj": "attn.to_out.0", "mlp.fc1": "ff.net.0.proj", "mlp.fc2": "ff.net.2"}


def write_synthetic_adapter(path: Path, config: ModelConfig, *, rank: int = 8, seed: int = 0, fmt: str = "kohya", std: float = 0.02,
                            alpha: float | None = None, linears: tuple[str, ...] = BLOCK_LINEARS, refiner: bool = True,
                            metadata: dict[str, str] | None = None) -> Path:
    """A random rank-`rank` adapter on every block's (and refiner block's) `linears` of a model of
    `config`, written to `path` in `fmt` ('kohya' or 'peft'); `alpha`: kohya's per-module alpha / the
    peft config's lora_alpha (None: alpha == rank, scale 1)."""
    from h3core.lora.adapter import model_linears

    shapes = model_linears(config)[0]
    modules = [f"{stack}.{i}.{linear}" for stack, count in (("blocks", config.num_blocks), ("token_refiner.blocks", config.refiner_blocks if refiner else 0))
               for i in range(count) for linear in linears]
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for module in modules:
        out_features, in_features = shapes[module]
        down = torch.randn(rank, in_features, generator=generator) * std
        up = torch.randn(out_features, rank, generator=generator) * std
        if fmt == "kohya":
            tensors.update(_kohya(module, down, up, alpha, rank))
        else:
            tensors.update(_peft(module, down, up))
    info = {"format": "pt", "h3_weights": "synthetic", **(metadata or {})}
    if fmt == "peft":
        info["lora_adapter_metadata"] = json.dumps({"transformer.r": rank, "transformer.lora_alpha": alpha if alpha is not None else rank,
                                                    "transformer.rank_pattern": {}, "transformer.alpha_pattern": {}})
    return write_safetensors(Path(path), {k: v.contiguous() for k, v in tensors.items()}, metadata=info)


def _kohya(module: str, down: torch.Tensor, up: torch.Tensor, alpha: float | None, rank: int) -> dict[str, torch.Tensor]:
    key = f"diffusion_model.{module}"
    out = {f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": up}
    if alpha is not None:
        out[f"{key}.alpha"] = torch.tensor(float(alpha))
    return out


def _peft(module: str, down: torch.Tensor, up: torch.Tensor) -> dict[str, torch.Tensor]:
    """diffusers' names: the fused qkv as to_q / to_k / to_v (one A each: the same A here), fc1's B rows [up; gate]."""
    stack, index, linear = module.rsplit(".", 3)[0], module.split(".")[-3], ".".join(module.split(".")[-2:])
    prefix = f"transformer.{'transformer_blocks' if stack == 'blocks' else 'token_refiner.refiner_blocks'}.{index}"
    if linear == "attn.qkv_proj":
        return {k: v for third, part in zip("qkv", up.chunk(3))
                for k, v in ((f"{prefix}.attn.to_{third}.lora_A.weight", down.clone()), (f"{prefix}.attn.to_{third}.lora_B.weight", part))}
    if linear == "mlp.fc1":
        gate, upper = up.chunk(2)
        up = torch.cat([upper, gate])
    name = _DIFFUSERS.get(linear, linear)
    return {f"{prefix}.{name}.lora_A.weight": down, f"{prefix}.{name}.lora_B.weight": up}
