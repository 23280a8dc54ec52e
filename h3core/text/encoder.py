"""`TextEncoder`: prompt -> the hidden states H3 conditions on, from a Qwen3-VL decoder's text path.

    tokenizer = check_text_encoder(path_or_None, hidden_size=config.text_dim)   # headers only
    encoder = load_text_encoder(path_or_None, hidden_size=config.text_dim, device=device, dtype=dtype)
    states = encoder.encode(prompt)          # [L, hidden] float32 CPU, L = every token of the prompt
    release_text_encoder(encoder)            # before the denoiser's peak

Tokens: the prompt as is (no template, no special tokens added; H3's tokenizer, see
`tokenizer.py`), never truncated. An empty prompt gives `[0, hidden]`.

Output layer: an index into Hugging Face's `hidden_states`: 0 is the token embedding, `k` the
output of decoder layer `k` (index `k - 1`), never normed; negative values count from the last
layer present (-1). Default: the checkpoint's own -- a truncated file (no final norm, as ComfyUI's
H3 file) its last layer; a whole decoder H3's `hidden_states[50]` (`config.H3_OUTPUT_LAYER`).
Layers past the output layer are neither read nor built, `lm_head` never, and the vision tower only
when a request has keyframes.

Keyframes: `encode_prompt(prompt, images)` presents the prompt after the images (`presentation.py`),
runs Qwen3-VL's vision tower (`vision.py`, loaded from the same open files on the first such call,
`inspect_vision` having checked its headers) on the image processor's patches
(`image_processor.py`), puts its merged rows at the image tokens with 3-axis M-RoPE positions and
adds its deepstack features after the first decoder layers (`model.Qwen3TextModel.forward_presented`).

Memory: the weights of the layers run live on `device` while loaded (`info.resident_bytes`); the
token embedding stays on disk and each prompt reads its rows (`weights.EmbeddingRows`). Release
drops every weight, closes the files and empties the CUDA cache; states come back on the CPU.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field

from PIL import Image

from h3core.errors import CheckpointError, ConfigError
from h3core.files.safetensors import SafetensorsReader
from h3core.runtime.device import resident_bytes
from h3core.text.assemble import assemble, assemble_vision
from h3core.text.checkpoint import (
    Markers,
    TextCheckpoint,
    check_tensors,
    has_final_norm,
    identify,
    vision_prefix,
    locate,
    resolve_config,
)
from h3core.text.config import H3_OUTPUT_LAYER, Qwen3TextConfig
from h3core.text.image_processor import ImageProcessor, read_processor_config
from h3core.text.model import Qwen3TextModel, VisualRows, multimodal_positions
from h3core.text.presentation import present
from h3core.text.synthetic import synthetic_text_encoder
from h3core.text.tokenizer import PromptTokenizer, TokenizerFiles, folder_tokenizer, shipped_tokenizer
from h3core.text.vision import Qwen3VisionTower
from h3core.text.vision_checkpoint import VisionSpec, inspect_vision
from h3core.text.weights import TextWeights

Kind = Literal["synthetic", "comfy", "qwen3-vl", "qwen3"]


class TextEncoderInfo(BaseModel):
    """What was loaded and what it cost, for the run report."""

    model_config = ConfigDict(frozen=True)

    kind: Kind = Field(description="The layout found in the files: synthetic, comfy (single file), qwen3-vl (HF / official), qwen3.")
    path: str = Field(description="The checkpoint path given (the synthetic encoder: its cached file).")
    bytes_on_disk: int = Field(description="Size of the checkpoint's safetensors files.")
    bytes_read: int = Field(description="Tensor bytes read from them so far: the layers run and the embedding rows of the prompts encoded.")
    resident_bytes: int = Field(description="Bytes of the weights held in memory while loaded.")
    layers: int = Field(description="Decoder layers run (those up to the output layer).")
    checkpoint_layers: int = Field(description="Decoder layers the checkpoint holds.")
    hidden_size: int = Field(description="Width of the hidden states returned.")
    output_layer: int = Field(description="Index into HF hidden_states (0 = embedding, k = output of decoder layer k), un-normed.")
    tokenizer: str = Field(description="Where the tokenizer came from (a folder, or h3's shipped copy).")
    linears: Literal["nvfp4", "dense", "mixed"] = Field(description="Storage of the decoder's linears.")
    linear_layouts: list[str] = Field(description="Their file layouts: nvfp4-comfy, nvfp4-modelopt, dense.")
    config_source: str = Field(description="config.json path, the file's header, or 'inferred from tensor shapes'.")
    device: str = Field(description="Device the weights live on.")
    dtype: str = Field(description="Compute dtype of the decoder.")
    vision: bool = Field(False, description="The checkpoint holds Qwen3-VL's vision tower (keyframes can be encoded).")
    vision_resident_bytes: int = Field(0, description="Bytes of the vision tower held in memory (0: not loaded: no keyframes yet).")
    images: int = Field(0, description="Keyframe images encoded so far.")


@dataclass(frozen=True)
class _Loaded:
    """What `info` reports that does not change while the encoder is loaded."""

    checkpoint: TextCheckpoint
    kind: Kind
    config: Qwen3TextConfig
    config_source: str
    layers: int
    linear_layouts: list[str]
    resident_bytes: int
    vision_prefix: str | None
    """Where the vision tower's tensors are (`visual.` / `model.visual.`); None: the checkpoint has none."""


class TextEncoder:
    """A loaded text encoder: `encode(prompt)` / `encode_ids(ids)` until `release()`."""

    def __init__(self, model: Qwen3TextModel, source: TextWeights, tokenizer: PromptTokenizer, loaded: _Loaded, dtype: torch.dtype):
        self._model: Qwen3TextModel | None = model
        self._source = source  # the open files: the embedding rows, and the vision tower if keyframes come
        self._reader = source.reader
        self.tokenizer = tokenizer
        self._loaded = loaded
        self.device, self.dtype = source.device, dtype
        self._vision_spec: VisionSpec | None = None
        self._vision: tuple[VisionSpec, Qwen3VisionTower] | None = None
        self._images = 0

    @property
    def hidden_size(self) -> int:
        return self._loaded.config.hidden_size

    @property
    def released(self) -> bool:
        return self._model is None

    @property
    def info(self) -> TextEncoderInfo:
        loaded = self._loaded
        layouts = set(loaded.linear_layouts)
        linears = "dense" if layouts <= {"dense"} else "nvfp4" if "dense" not in layouts else "mixed"
        return TextEncoderInfo(
            kind=loaded.kind, path=str(loaded.checkpoint.path), bytes_on_disk=loaded.checkpoint.bytes_on_disk,
            bytes_read=self._reader.bytes_read, resident_bytes=loaded.resident_bytes, layers=loaded.layers,
            checkpoint_layers=loaded.config.num_layers, hidden_size=loaded.config.hidden_size, output_layer=loaded.layers,
            tokenizer=self.tokenizer.name, linears=linears, linear_layouts=loaded.linear_layouts,
            config_source=loaded.config_source, device=str(self.device), dtype=str(self.dtype).removeprefix("torch."),
            vision=self.has_vision, vision_resident_bytes=resident_bytes(self._vision[1]) if self._vision else 0, images=self._images,
        )

    def token_ids(self, prompt: str, max_tokens: int | None = None) -> list[int]:
        """The prompt's token ids, all of them; more than `max_tokens` (when given) is refused."""
        ids = self.tokenizer.encode(prompt)
        if max_tokens is not None and len(ids) > max_tokens:
            raise ConfigError(
                f"the prompt is {len(ids)} tokens, more than the {max_tokens} this model takes; shorten it "
                "(h3 never drops tokens: H3's reference encodes every one)"
            )
        return ids

    def encode(self, prompt: str, max_tokens: int | None = None) -> torch.Tensor:
        """`[L, hidden_size]` float32 CPU states of every token of `prompt` (`max_tokens`: see `token_ids`)."""
        return self.encode_ids(self.token_ids(prompt, max_tokens))

    def encode_ids(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """`[L, hidden_size]` float32 CPU output-layer states of the given token ids."""
        return self._states(token_ids).to(dtype=torch.float32)

    def encode_prompt(
        self, prompt: str, images: Sequence[Image.Image] = (), max_tokens: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(states [L', hidden_size], tags [L'] int64)`: the output-layer states (encoder dtype, CPU) of
        the prompt presented after `images` (prepared RGB keyframes, in packed order) as
        `presentation.present` lays it out, and each row's tag (1 text, 0 a vision block's tokens).
        Without images: `encode(prompt)`'s states (in the encoder dtype) and all-ones tags. More than
        `max_tokens` rows in all (when given) is refused."""
        if not images:
            ids = self.token_ids(prompt, max_tokens)
            return self._states(ids), torch.ones(len(ids), dtype=torch.int64)
        spec = self.vision_spec()  # headers: nothing of the tower is read before the request is known to fit
        shown = present(self.tokenizer, prompt, [spec.processor.image_tokens(image.size) for image in images])
        if max_tokens is not None and len(shown.token_ids) > max_tokens:
            raise ConfigError(
                f"the prompt with its {len(images)} keyframe(s) is {len(shown.token_ids)} tokens, more than the {max_tokens} this "
                "model takes; shorten the prompt or use smaller keyframes"
            )
        ids = self._checked_ids(shown.token_ids)
        _, tower = self.vision_tower()
        pixel_values, grids = spec.processor.pixel_values(images)
        merge = spec.config.spatial_merge_size
        embeds, deepstack = tower(pixel_values, grids)  # [K, D], [[K, D]] * len(deepstack layers)
        rows = torch.tensor([i for span in shown.image_spans for i in span], device=self.device)
        positions = multimodal_positions(len(ids), shown.image_spans, grids, merge)  # [3, L']
        states = self._model_or_raise().forward_presented(ids.to(self.device), positions, VisualRows(rows, embeds, deepstack))
        self._images += len(images)
        return states.to(device="cpu"), torch.tensor(shown.tags, dtype=torch.int64)

    @property
    def has_vision(self) -> bool:
        """Whether the checkpoint holds a vision tower (read only when a request has keyframes)."""
        return self._loaded.vision_prefix is not None

    def _states(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """`[L, hidden_size]` output-layer states on the CPU in the encoder dtype."""
        model = self._model_or_raise()
        ids = self._checked_ids(token_ids)  # [L]
        if ids.numel() == 0:
            return torch.zeros(0, self.hidden_size, dtype=self.dtype)
        return model(ids).to(device="cpu")  # [L, D]

    def _model_or_raise(self) -> Qwen3TextModel:
        if self._model is None:
            raise RuntimeError("text encoder was released; load it again to encode")
        return self._model

    def _checked_ids(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)  # [L]
        vocab = self._loaded.config.vocab_size
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            bad = int(ids.max()) if int(ids.max()) >= vocab else int(ids.min())
            raise CheckpointError(f"token id {bad} is outside the embedding's {vocab} rows: the ids do not belong to these weights")
        return ids

    def vision_spec(self) -> VisionSpec:
        """The vision tower's config, processor and prefix, checked from the headers (once); a
        `KeyframeError` line when the checkpoint has none."""
        self._model_or_raise()
        if self._vision_spec is None:
            loaded = self._loaded
            self._vision_spec = inspect_vision(self._reader, self._source.markers, loaded.kind, loaded.checkpoint, loaded.config)
        return self._vision_spec

    def vision_tower(self) -> tuple[VisionSpec, Qwen3VisionTower]:
        """The vision tower, read and built from the open files on the first call (`encode_prompt`
        makes it on the first request with images), with its spec."""
        spec = self.vision_spec()
        if self._vision is None:
            self._vision = spec, assemble_vision(self._source, spec.prefix, spec.config, dtype=self.dtype)
        return self._vision

    def release(self) -> None:
        """Drop the weights (the vision tower's too), close the files (and empty the CUDA cache); encoding is no longer possible."""
        self._model = None
        self._vision = None
        self._reader.close()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def release_text_encoder(encoder: TextEncoder) -> None:
    """Free every weight of the encoder so the denoiser's sampling loop does not carry them."""
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
    """The text encoder at `path` (file or folder), or the synthetic one (`seed`) when `path` is None.

    `hidden_size` is the denoiser's text width: a checkpoint of another width is refused, the
    synthetic encoder is built to it.
    """
    if path is None:
        path, _ = synthetic_text_encoder(hidden_size, seed)
    found = _inspect(Path(path), hidden_size, output_layer)
    device = torch.device(device)
    source = TextWeights(found.reader, found.markers, device)
    try:
        model = assemble(source, found.prefix, found.config, layers=found.layers, dtype=dtype)
    except BaseException:
        found.reader.close()
        raise
    loaded = _Loaded(
        found.checkpoint, found.kind, found.config, found.config_source, found.layers, sorted(source.kinds), resident_bytes(model),
        vision_prefix(found.reader, found.kind),
    )
    return TextEncoder(model, source, found.tokenizer, loaded, dtype)


def check_text_encoder(
    path: str | Path | None, *, hidden_size: int, output_layer: int | None = None, images: bool = False
) -> PromptTokenizer:
    """Everything `load_text_encoder` checks before reading weights (files, layout, config, shapes,
    markers, tokenizer; with `images`, the vision tower and the image processor too); returns the
    encoder's tokenizer, whose `encode` gives the ids `encode` uses.

    Cheap: headers only. The launcher calls it before spawning ranks, so a bad path is one line
    from the launching process and the prompt's token count is known before the partition is checked.
    """
    if path is None and not images:
        from h3core.text.synthetic import synthetic_config

        synthetic_config(hidden_size)  # the width check; the synthetic vocabulary covers the tokenizer
        return shipped_tokenizer()
    if path is None:  # keyframes: the synthetic file (built once, cached) holds the tower to check
        path, _ = synthetic_text_encoder(hidden_size, 0)
    found = _inspect(Path(path), hidden_size, output_layer)
    try:
        if images:
            inspect_vision(found.reader, found.markers, found.kind, found.checkpoint, found.config)
    finally:
        found.reader.close()
    return found.tokenizer


def vision_tower_bytes(path: str | Path | None, *, hidden_size: int) -> int:
    """Bytes the vision tower of the text encoder at `path` (None: the synthetic one) takes once loaded
    (its tensors' stored size: it is kept in the stored dtype); 0 when it has none. Headers only."""
    if path is None:
        path, _ = synthetic_text_encoder(hidden_size, 0)
    checkpoint = locate(Path(path))
    with SafetensorsReader(checkpoint.files) as reader:
        kind, _ = identify(reader, Path(path))
        prefix = vision_prefix(reader, kind)
        return 0 if prefix is None else sum(reader.nbytes(name) for name in reader.keys() if name.startswith(prefix))


def image_processor_for(path: str | Path | None) -> ImageProcessor:
    """The image processor a text encoder's keyframes go through (its folder's
    `preprocessor_config.json`, else the official values): what `ImageProcessor.image_tokens` needs
    to count a presentation's rows before anything is loaded. Reads no weights."""
    if path is None:
        return ImageProcessor()
    return ImageProcessor(read_processor_config(locate(Path(path)).processor_folders))


def resolve_output_layer(output_layer: int | None, num_layers: int, *, whole_decoder: bool, where: Path) -> int:
    """The index into `hidden_states` to return (see the module docstring), checked against the layers present."""
    if output_layer is None:
        layer = H3_OUTPUT_LAYER if whole_decoder else num_layers
    else:
        layer = output_layer + num_layers + 1 if output_layer < 0 else output_layer
    if layer < 0:
        raise ConfigError(f"text encoder output layer {output_layer} is before the embedding of a {num_layers}-layer decoder")
    if layer > num_layers:
        asked = "asked for" if output_layer is not None else f"H3 conditions on (hidden_states[{H3_OUTPUT_LAYER}])"
        raise CheckpointError(
            f"text encoder {where} has {num_layers} decoder layers, fewer than the output layer {layer} {asked}; "
            f"use a checkpoint that keeps at least layers 0..{layer - 1}"
        )
    return layer


@dataclass
class _Inspected:
    """A text-encoder checkpoint checked from its headers, config, markers and tokenizer; no weight read."""

    checkpoint: TextCheckpoint
    reader: SafetensorsReader
    markers: Markers
    kind: Kind
    prefix: str
    config: Qwen3TextConfig
    config_source: str
    layers: int
    tokenizer: PromptTokenizer


def _inspect(path: Path, hidden_size: int, output_layer: int | None) -> _Inspected:
    checkpoint = locate(path)
    reader = SafetensorsReader(checkpoint.files)  # parses every header: a truncated shard fails here
    try:
        kind, prefix = identify(reader, path)
        config, config_source = resolve_config(reader, prefix, kind, checkpoint)
        if config.hidden_size != hidden_size:
            raise CheckpointError(
                f"text encoder {path} has hidden size {config.hidden_size} but the denoiser takes text "
                f"of width {hidden_size}: the encoder does not match the denoiser"
            )
        layers = resolve_output_layer(output_layer, config.num_layers, whole_decoder=has_final_norm(reader, prefix), where=path)
        markers = Markers(reader)
        check_tensors(reader, markers, prefix, config, layers)
        tokenizer = _tokenizer(checkpoint, kind, path)
        if tokenizer.vocab_size > config.vocab_size:
            raise CheckpointError(
                f"tokenizer {tokenizer.name} has ids up to {tokenizer.vocab_size - 1} but the embedding of {path} "
                f"has {config.vocab_size} rows: the tokenizer does not belong to these weights"
            )
    except BaseException:
        reader.close()
        raise
    return _Inspected(checkpoint, reader, markers, kind, prefix, config, config_source, layers, tokenizer)  # type: ignore[arg-type]


def _tokenizer(checkpoint: TextCheckpoint, kind: Kind, where: Path) -> PromptTokenizer:
    """A folder's own tokenizer (required for HF / official folders); h3's shipped one for a single
    file and for Comfy-layout files, which never carry one, unless their folder does."""
    folders = checkpoint.tokenizer_folders
    own = any(TokenizerFiles.find(folder) is not None for folder in folders)
    if folders and (own or kind not in ("comfy", "synthetic")):
        return folder_tokenizer(folders, where)
    return shipped_tokenizer()
