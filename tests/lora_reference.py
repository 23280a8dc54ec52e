"""The reference side of the LoRA tests: adapters written by the test in the formats h3 reads, and
diffusers 0.42.1's model with them loaded the way its pipeline loads them.

Nothing here uses h3. A diffusers/PEFT adapter is made by peft on a diffusers model (random matrices)
and saved by diffusers' `MiniMaxH3LoraLoaderMixin.save_lora_weights` (its `lora_adapter_metadata`
carries the `LoraConfig`: rank, alpha, rank_pattern); a kohya/ComfyUI adapter is written directly in
the original names (`diffusion_model.blocks.N.attn.qkv_proj.lora_down.weight`, `.alpha`), or
flattened under `lora_unet_` as musubi-tuner writes it. The reference loads either with what
`load_lora_weights` runs for the transformer: `lora_state_dict` (diffusers' own conversion of the
non-diffusers names) and `load_lora_adapter` (peft), then `set_adapters` for the scales.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

BLOCK_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"]
FULL_TARGETS = BLOCK_TARGETS + ["adaln_proj.linear", "context_embedder", "proj_in", "proj_out", "norm_out.linear", "time_embedder.linear_1"]
"""peft target modules: every block linear (the refiner's too), and on the full model the AdaLN
projections, the timestep MLP and the input / output projections (float32 islands among them)."""

KOHYA_BLOCK = ["attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2"]
KOHYA_STANDALONE = ["condition_proj", "video_patch_proj", "final_layer.video_out", "time_embedder.proj_in"]


def peft_adapter(path: Path, *, seed: int, targets: list[str], rank: int = 4, alpha: float = 8.0,
                 rank_pattern: dict[str, int] | None = None, alpha_pattern: dict[str, float] | None = None, std: float = 0.1) -> Path:
    """A random peft adapter on the small diffusers model, saved as diffusers saves one (`path`: the file)."""
    from diffusers.loaders.lora_pipeline import MiniMaxH3LoraLoaderMixin
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    import h3_reference as ref

    model = ref.random_model()
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, rank_pattern=rank_pattern or {},
                        alpha_pattern=alpha_pattern or {}, init_lora_weights=False)
    model.add_adapter(config, adapter_name="adapter")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * std)
    layers = get_peft_model_state_dict(model, adapter_name="adapter")
    MiniMaxH3LoraLoaderMixin.save_lora_weights(path.parent, transformer_lora_layers=layers, weight_name=path.name,
                                               transformer_lora_adapter_metadata=config.to_dict())
    return path


def kohya_adapter(path: Path, state: dict[str, torch.Tensor], modules: list[str], *, seed: int, rank: int = 4,
                  ranks: dict[str, int] | None = None, alpha: float | None = 2.0, prefix: str = "diffusion_model.",
                  flat: bool = False, std: float = 0.1) -> Path:
    """A random kohya/ComfyUI adapter in the original names over `modules` (shapes from `state`, the
    checkpoint's weights by original name): `lora_down [r, in]`, `lora_up [out, r]` (qkv rows stacked,
    fc1 rows [gate; up]) and an `alpha` per module; `flat`: musubi-tuner's `lora_unet_` names."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for module in modules:
        out_features, in_features = state[f"{module}.weight"].shape
        r = next((v for k, v in (ranks or {}).items() if module.endswith(k)), rank)
        key = f"lora_unet_{module.replace('.', '_')}" if flat else prefix + module
        tensors[f"{key}.lora_down.weight"] = torch.randn(r, in_features, generator=generator) * std
        tensors[f"{key}.lora_up.weight"] = torch.randn(out_features, r, generator=generator) * std
        if alpha is not None:
            tensors[f"{key}.alpha"] = torch.tensor(alpha * r / rank)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def peft_dump(src: Path, path: Path, alpha: float) -> Path:
    """`src` (a diffusers-saved PEFT file) as lightx2v publishes its adapters: bare diffusers module names
    with peft's `.default.` infix (`transformer_blocks.0.attn.to_q.lora_A.default.weight`), no peft
    config, the training alpha in `__metadata__["alpha"]`."""
    from safetensors.torch import load_file

    tensors = {k.removeprefix("transformer.").replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v
               for k, v in load_file(str(src)).items()}
    save_file(tensors, str(path), metadata={"format": "pt", "alpha": str(alpha)})
    return path


def block_modules(state: dict[str, torch.Tensor], names: list[str] = KOHYA_BLOCK, adaln: bool = False) -> list[str]:
    """Every block's (and refiner block's) `names` present in `state`, plus the blocks' AdaLN projections."""
    out = []
    for weight in sorted(state):
        module = weight.removesuffix(".weight")
        if weight.endswith(".weight") and any(module.endswith("." + n) for n in names):
            out.append(module)
        elif adaln and weight.endswith(".adaln_proj.linear.weight") and weight.startswith("blocks."):
            out.append(module)
    return out


def with_adapters(model, adapters: list[tuple[Path, float]]):
    """`model` (a diffusers MiniMaxH3Transformer3DModel) with every adapter loaded as the pipeline's
    `load_lora_weights` loads it into the transformer, active at its scale."""
    from diffusers.loaders.lora_pipeline import MiniMaxH3LoraLoaderMixin

    names = []
    for i, (path, _) in enumerate(adapters):
        state, metadata = MiniMaxH3LoraLoaderMixin.lora_state_dict(str(path), return_lora_metadata=True)
        model.load_lora_adapter(state, network_alphas=None, adapter_name=f"a{i}", metadata=metadata)  # as load_lora_into_transformer
        names.append(f"a{i}")
    model.set_adapters(names, weights=[scale for _, scale in adapters])
    return model

