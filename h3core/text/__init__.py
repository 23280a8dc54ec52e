"""The text encoder: a Qwen3 / Qwen3-VL decoder's text path on h3's NVFP4 linears (see encoder.py)."""

from h3core.text.encoder import (
    TextEncoder,
    TextEncoderInfo,
    check_text_encoder,
    load_text_encoder,
    release_text_encoder,
    resolve_output_layer,
)

__all__ = ["TextEncoder", "TextEncoderInfo", "check_text_encoder", "load_text_encoder", "release_text_encoder", "resolve_output_layer"]
