"""LoRA adapters on h3's model, in both modes: read, checked, and applied beside each linear.

A LoRA adapter is a low-rank branch `y = W x + s * B(A x)` beside a linear; h3 never rewrites the
linear's (NVFP4) weight: its bytes stay as the checkpoint holds them, and taking the branches off
gives the base model back bit for bit (../shared/DESIGN.md §8).

- `spec`      `LoraSpec` (a request's `--lora PATH[:SCALE]`) and the flag's parser
- `keys`      the formats (diffusers/PEFT, kohya/ComfyUI, original names with lora_A/B), detected
              from the key names, mapped onto h3's linears (original names, stacked qkv, [gate; up])
- `adapter`   a file opened against a model: pairs checked (shapes, ranks, finite values, what a
              pruned checkpoint removed), their `alpha / rank` as diffusers computes it
- `schedule`  the sampling schedule an adapter's metadata asks for (h3's `h3.*` keys)
- `branch`    `LowRankBranch`, the module beside a `DenseLinear` / `NVFP4Linear` (`linear.lora`)
- `tensor`    tensor mode's cut of a branch: exactly its linear's (the shard's `TensorCut`)
- `attach`    a request's adapters on a loaded model, and off again (per request, base resident)
- `plan`      a run's adapters before any rank starts: records, sha256, bytes per rank
"""

from h3core.lora.spec import LoraSpec, parse_lora

__all__ = ["LoraSpec", "parse_lora"]
