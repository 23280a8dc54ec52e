"""The text encoder: Qwen3-VL's text path (H3's conditioner) on h3's NVFP4 linears (see encoder.py)."""

from h3core.text.encoder import (
    TextEncoder,
    TextEncoderInfo,
    check_text_encoder,
    load_text_encoder,
    release_text_encoder,
    resolve_output_layer,
)

__all__ = ["TextEncoder", "TextEncoderInfo", "check_text_encoder", "load_text_encoder", "release_text_encoder", "resolve_output_layer"]
