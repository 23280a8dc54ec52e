"""`TextEncoder`: prompt -> hidden states of one layer of a Qwen3 / Qwen3-VL decoder's text path.

    encoder = load_text_encoder(path_or_None, hidden_size=config.text_dim, device=device)
    states = encoder.encode(prompt, max_tokens=config.max_text_tokens)   # [L, hidden], float32, CPU
    negative = encoder.encode(negative_prompt, max_tokens=...)
    release_text_encoder(encoder)     # before the denoiser's sampling loop

Tokens: the prompt is tokenized as `tokenizer.json` says (Qwen's adds no special tokens) and
the first `max_tokens` tokens are kept; the rest are dropped. A prompt with no tokens (the empty
string) gives a `[0, hidden]` tensor. Causal attention makes a token's state depend only on the
tokens before it, so truncation never changes the states of the tokens that are kept.

Output layer: counted as Hugging Face's `hidden_states` tuple: 0 is the token embedding, `k` the
output of decoder layer `k`, and the last (`num_layers`, the default, or -1) the final-norm
output, i.e. `last_hidden_state`. Layers past the output layer are neither read nor built.

Memory: the encoder never resets or reads CUDA peak-memory statistics; the pipeline brackets its
phases (reset, load + encode, read the peak, `release_text_encoder`). After release no tensor of
the encoder stays allocated (its states come back on the CPU) and the CUDA cache is emptied.
`info.resident_bytes` is the weight memory the encoder holds while loaded.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from h3core.errors import CheckpointError, ConfigError
from h3core.files.safetensors import SafetensorsReader
from h3core.nvfp4.io import CheckpointWeights
from h3core.runtime.device import resident_bytes
from h3core.text.assemble import assemble
from h3core.text.checkpoint import (
    check_tensors,
    checkpoint_files,
    find_layout,
    read_headers,
    resolve_config,
)
from h3core.text.config import Qwen3TextConfig
from h3core.text.model import Qwen3TextModel
from h3core.text.synthetic import SYNTHETIC_PREFIX, SyntheticWeights, synthetic_config
from h3core.text.tokenizer import TOKENIZER_FILE, ByteTokenizer, FileTokenizer, PromptTokenizer


class TextEncoderInfo(BaseModel):
    """What was loaded, for the run report."""

    model_config = ConfigDict(frozen=True)

    kind: Literal["synthetic", "qwen3", "qwen3-vl"] = Field(description="Synthetic, or the key layout of the checkpoint.")
    path: str | None = Field(description="The checkpoint path given (None for synthetic).")
    bytes_on_disk: int = Field(description="Size of the checkpoint's safetensors files (0 for synthetic).")
    bytes_read: int = Field(description="Tensor bytes read from them: the text path only, never the vision tower or lm_head.")
    resident_bytes: int = Field(description="Bytes of the weights held in memory while loaded.")
    layers: int = Field(description="Decoder layers run (those up to the output layer).")
    checkpoint_layers: int = Field(description="Decoder layers the checkpoint (or synthetic config) has.")
    hidden_size: int = Field(description="Width of the hidden states returned.")
    output_layer: int = Field(description="Index into hidden_states (0 = embedding, last = final-norm output).")
    tokenizer: str = Field(description="The tokenizer.json used, or 'byte-level'.")
    linears: Literal["nvfp4", "dense", "mixed"] = Field(description="Storage of the decoder's linears.")
    config_source: str = Field(description="config.json path, 'inferred from tensor shapes', or 'synthetic'.")
    device: str = Field(description="Device the weights live on.")
    dtype: str = Field(description="Compute dtype of the decoder.")


class TextEncoder:
    """A loaded text encoder: `encode(prompt, max_tokens)` until `release()`."""

    def __init__(self, model: Qwen3TextModel, tokenizer: PromptTokenizer, info: TextEncoderInfo, device: torch.device):
        self._model: Qwen3TextModel | None = model
        self.tokenizer = tokenizer
        self.info = info
        self.device = device

    @property
    def hidden_size(self) -> int:
        return self.info.hidden_size

    @property
    def released(self) -> bool:
        return self._model is None

    def token_ids(self, prompt: str, max_tokens: int) -> list[int]:
        """The prompt's token ids, the first `max_tokens` kept."""
        if max_tokens < 1:
            raise ConfigError(f"max_tokens must be at least 1, got {max_tokens}")
        return self.tokenizer.encode(prompt)[:max_tokens]

    def encode(self, prompt: str, max_tokens: int) -> torch.Tensor:
        """`[L, hidden_size]` float32 CPU hidden states of the prompt's first `L <= max_tokens` tokens."""
        if self._model is None:
            raise RuntimeError("text encoder was released; load it again to encode")
        ids = self.token_ids(prompt, max_tokens)
        if not ids:
            return torch.zeros(0, self.hidden_size)
        if max(ids) >= self._model.vocab_size:
            raise CheckpointError(
                f"tokenizer {self.tokenizer.name} produced token id {max(ids)} but the embedding has "
                f"{self._model.vocab_size} rows: the tokenizer does not belong to these weights"
            )
        token_ids = torch.tensor(ids, dtype=torch.long, device=self.device)  # [L]
        return self._model(token_ids).to(device="cpu", dtype=torch.float32)  # [L, D]

    def release(self) -> None:
        """Drop the weights (and empty the CUDA cache); `encode` is no longer possible."""
        self._model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def release_text_encoder(encoder: TextEncoder) -> None:
    """Free the encoder's weights so the denoiser's sampling loop does not carry them."""
    encoder.release()


def load_text_encoder(
    path: str | Path | None,
    *,
    hidden_size: int,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    output_layer: int | None = None,
) -> TextEncoder:
    """The checkpoint at `path` (file or folder), or the synthetic encoder when `path` is None.

    `hidden_size` is the denoiser's text width: a checkpoint of another width is refused, the
    synthetic encoder is built to it. `seed` only matters for the synthetic encoder.
    """
    device = torch.device(device)
    if path is None:
        return _load_synthetic(hidden_size, seed, device, dtype, output_layer)
    return _load_checkpoint(Path(path), hidden_size, device, dtype, output_layer)


def resolve_output_layer(output_layer: int | None, num_layers: int) -> int:
    """An index into `hidden_states` (`num_layers + 1` entries), negative counting from the end."""
    if output_layer is None:
        return num_layers
    resolved = output_layer + num_layers + 1 if output_layer < 0 else output_layer
    if not 0 <= resolved <= num_layers:
        raise ConfigError(
            f"text encoder output layer {output_layer} is outside -{num_layers + 1}..{num_layers} "
            f"for a {num_layers}-layer decoder (0 = embedding, {num_layers} or -1 = last)"
        )
    return resolved


def _load_synthetic(
    hidden_size: int, seed: int, device: torch.device, dtype: torch.dtype, output_layer: int | None
) -> TextEncoder:
    config = synthetic_config(hidden_size)
    layer = resolve_output_layer(output_layer, config.num_layers)
    source = SyntheticWeights(config, seed, device)
    model = assemble(
        source, SYNTHETIC_PREFIX, config, layers=layer, final_norm=layer == config.num_layers, dtype=dtype
    )
    info = TextEncoderInfo(
        kind="synthetic", path=None, bytes_on_disk=0, bytes_read=0, resident_bytes=resident_bytes(model),
        layers=layer, checkpoint_layers=config.num_layers, hidden_size=hidden_size, output_layer=layer,
        tokenizer=ByteTokenizer.name, linears="nvfp4", config_source="synthetic", device=str(device),
        dtype=str(dtype).removeprefix("torch."),
    )
    return TextEncoder(model, ByteTokenizer(), info, device)


@dataclass
class _Inspected:
    """A text-encoder checkpoint checked from its headers, config and tokenizer; no weight read yet."""

    files: list[Path]
    reader: SafetensorsReader
    headers: dict
    kind: str
    prefix: str
    config: Qwen3TextConfig
    config_source: str
    layer: int
    final_norm: bool
    tokenizer: FileTokenizer


def _inspect(path: Path, hidden_size: int, output_layer: int | None) -> _Inspected:
    files = checkpoint_files(path)
    folder = path if path.is_dir() else path.parent
    reader = SafetensorsReader(files)  # parses every header: a truncated shard fails here
    try:
        headers = read_headers(reader)
        kind, prefix = find_layout(headers, path)
        config, config_source = resolve_config(headers, prefix, kind, folder, path)
        if config.hidden_size != hidden_size:
            raise CheckpointError(
                f"text encoder {path} has hidden size {config.hidden_size} but the denoiser takes text "
                f"of width {hidden_size}: the encoder does not match the denoiser"
            )
        layer = resolve_output_layer(output_layer, config.num_layers)
        final_norm = layer == config.num_layers
        check_tensors(headers, prefix, config, layer, final_norm=final_norm)
        tokenizer = FileTokenizer(folder / TOKENIZER_FILE)  # before any weight is read: fail fast
    except BaseException:
        reader.close()
        raise
    return _Inspected(files, reader, headers, kind, prefix, config, config_source, layer, final_norm, tokenizer)


def check_text_encoder(path: str | Path | None, *, hidden_size: int, output_layer: int | None = None) -> PromptTokenizer:
    """Everything `load_text_encoder` checks before reading weights (files, config, shapes, tokenizer);
    returns the encoder's tokenizer (the byte-level one of the synthetic encoder when `path` is None).

    Cheap: headers only. The launcher calls it before spawning ranks, so a bad path is one line
    from the launching process rather than a rank failure, and the prompt's real token count is
    known before the partition is checked.
    """
    if path is None:
        return ByteTokenizer()
    found = _inspect(Path(path), hidden_size, output_layer)
    found.reader.close()
    return found.tokenizer


def _load_checkpoint(
    path: Path, hidden_size: int, device: torch.device, dtype: torch.dtype, output_layer: int | None
) -> TextEncoder:
    found = _inspect(path, hidden_size, output_layer)
    reader, config, layer = found.reader, found.config, found.layer
    source = CheckpointWeights(reader, device)
    try:
        model = assemble(source, found.prefix, config, layers=layer, final_norm=found.final_norm, dtype=dtype)
    finally:
        reader.close()
    info = TextEncoderInfo(
        kind=found.kind, path=str(path), bytes_on_disk=sum(f.stat().st_size for f in found.files),
        bytes_read=reader.bytes_read, resident_bytes=resident_bytes(model), layers=layer,
        checkpoint_layers=config.num_layers, hidden_size=config.hidden_size, output_layer=layer,
        tokenizer=found.tokenizer.name, linears=_linear_kind(source.kinds), config_source=found.config_source,
        device=str(device), dtype=str(dtype).removeprefix("torch."),
    )
    return TextEncoder(model, found.tokenizer, info, device)


def _linear_kind(kinds: set[str]) -> Literal["nvfp4", "dense", "mixed"]:
    if kinds == {"nvfp4"}:
        return "nvfp4"
    return "dense" if kinds <= {"dense"} else "mixed"
