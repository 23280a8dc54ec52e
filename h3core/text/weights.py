"""The text encoder's weights, read from one opened checkpoint in whichever storage it has.

- Linears: Comfy NVFP4 (`h3core.nvfp4.comfy.read_nvfp4_linear`, converted to h3's layout at load),
  ModelOpt NVFP4 (`h3core.nvfp4.io.read_linear`), or `DenseLinear` in the stored dtype.
- The token embedding stays on disk: `EmbeddingRows` reads the rows a prompt uses when it is
  encoded (a float table, or Comfy int8 rows times their per-row scales), so neither the 0.78 GB
  int8 table of the NVFP4 file nor the 1.56 GB bf16 one of the official shards is ever read whole
  or held in memory. The reader stays open until the encoder is released.
"""

from __future__ import annotations

import torch
from torch import nn

from h3core.files.safetensors import SafetensorsReader
from h3core.nvfp4 import comfy
from h3core.nvfp4.io import read_linear
from h3core.nvfp4.kernels import DeviceKernels
from h3core.nvfp4.linear import DenseLinear
from h3core.text.checkpoint import EMBEDDING, Markers, embedding_quant, linear_kind


class TextWeights:
    """Hands out the decoder's tensors, linears and token embedding from `reader` onto `device`.
    `kinds` records the storages of the linears read (`checkpoint.LINEAR_KINDS`). Its NVFP4 linears
    share one `DeviceKernels` (the device's facts, asked once for all of them)."""

    def __init__(self, reader: SafetensorsReader, markers: Markers, device: torch.device, kernels: DeviceKernels | None = None):
        self.reader, self.markers, self.device = reader, markers, device
        self.kernels = kernels or DeviceKernels.of(device)
        self.kinds: set[str] = set()

    def tensor(self, name: str) -> torch.Tensor:
        return self.reader.get(name).to(self.device)

    def linear(self, prefix: str, out_features: int, in_features: int) -> nn.Module:
        kind = linear_kind(self.reader, self.markers, prefix)
        self.kinds.add(kind)
        if kind == "nvfp4-comfy":
            quant = self.markers(prefix)
            assert quant is not None
            return comfy.read_nvfp4_linear(self.reader, prefix, out_features, in_features, quant, self.device, self.kernels)
        if kind == "nvfp4-modelopt":
            return read_linear(self.reader, prefix, device=self.device, kernels=self.kernels)
        bias = self.tensor(f"{prefix}.bias") if f"{prefix}.bias" in self.reader else None
        return DenseLinear(self.tensor(f"{prefix}.weight"), bias)

    def embedding(self, prefix: str) -> "EmbeddingRows":
        return EmbeddingRows(self.reader, f"{prefix}{EMBEDDING}", embedding_quant(self.markers, prefix), self.device)


class EmbeddingRows(nn.Module):
    """Token ids -> float32 embedding rows on `device`, read from the checkpoint per call (no weights held)."""

    def __init__(self, reader: SafetensorsReader, module: str, quant: comfy.ComfyQuant | None, device: torch.device):
        super().__init__()
        self.reader, self.module, self.quant, self.device = reader, module, quant, device
        self.vocab_size, self.hidden_size = reader.shape(f"{module}.weight")

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:  # token_ids: [L] -> [L, D] float32
        unique, inverse = torch.unique(token_ids.cpu(), return_inverse=True)  # sorted distinct ids [U]
        runs = _runs(unique.tolist())
        rows = self.reader.get_rows(f"{self.module}.weight", runs)  # [U, D], stored dtype
        if self.quant is None:
            values = rows.float()
        else:
            values = comfy.dequantize_int8(rows, self._scale_rows(runs))
        return values[inverse].to(self.device)

    def _scale_rows(self, runs: list[range]) -> torch.Tensor:
        name = f"{self.module}.weight_scale"
        if self.reader.shape(name) in ((), (1,)):
            return self.reader.get(name).reshape(())  # one scale for the table
        return self.reader.get_rows(name, runs).reshape(-1, 1)  # [U, 1]


def _runs(sorted_ids: list[int]) -> list[range]:
    """Maximal runs of consecutive ids, each one read: [3, 4, 5, 9] -> [range(3, 6), range(9, 10)]."""
    runs: list[range] = []
    for token_id in sorted_ids:
        if runs and runs[-1].stop == token_id:
            runs[-1] = range(runs[-1].start, token_id + 1)
        else:
            runs.append(range(token_id, token_id + 1))
    return runs
