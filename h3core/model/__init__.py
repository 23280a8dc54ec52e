"""MiniMax-H3's transformer (DESIGN.md §2), knowing nothing about parallelism.

- `config`      `ModelConfig`, the named presets, and the frame/latent arithmetic of a request
- `sequence`    the packed sequence's layout: `text | audio | video` segments (torch-free)
- `positions`   the (t, h, w) RoPE positions of a packed sequence, as the reference builds them
- `inputs`      RoPE angles, the clocks of a step, a rank's rows of a packed sequence
- `dit`         the transformer (`H3Model`) and the declaration of which linears tensor mode splits
- `packing`     one packed sequence in diffusers' argument convention, as `PackedSequence`
- `attention`   the attention backends and the record of the kernels that ran
- `sampler`     the two flow-match schedules, the Euler update, the official noise (no model inside)
- `checkpoint`  the loader over every checkpoint layout (`h3core.checkpoints`), `load_transformer`
- `synthetic`   the embedded synthetic checkpoint in the seed's layout: writer, cache

`load_transformer(path, *, dtype=None, device="cpu")` is the public entry point (docs/checkpoint.md).
"""


def __getattr__(name: str):  # lazy: `h3core.model.config` stays importable without torch
    if name == "load_transformer":
        from h3core.model.checkpoint import load_transformer

        return load_transformer
    raise AttributeError(f"module 'h3core.model' has no attribute {name!r}")
