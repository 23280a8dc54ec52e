"""MiniMax-H3's transformer (DESIGN.md §2), knowing nothing about parallelism.

- `config`      `ModelConfig`, the named presets, and the frame/latent arithmetic of a request
- `sequence`    the packed sequence's layout: `text | audio | video` segments (torch-free)
- `positions`   the (t, h, w) RoPE positions of a packed sequence, as the reference builds them
- `inputs`      RoPE angles, the clocks of a step, a rank's rows of a packed sequence
- `rope`        rotating q and k by those angles (`apply_rope`)
- `dit`         the transformer (`H3Model`), its attention module and default processor
- `packing`     one packed sequence in diffusers' argument convention, as `PackedSequence`, and
                `diffusers_forward`, the adapter that runs an `H3Model` on it
- `attention`   the attention kernels behind one interface (`dispatch`), h3's SDPA rule table
                (`sdpa_rule`) and the backends' pre-run checks (`checks`)
- `sampler`     the two flow-match schedules, the Euler update, the official noise (no model inside)
- `checkpoint`  the loader over every checkpoint layout (`h3core.checkpoints`), `load_transformer`
- `synthetic`   the embedded synthetic checkpoint in the seed's layout: writer, cache

`load_transformer(path, *, dtype=None, device="cpu")` is the public entry point, with
`packing.diffusers_forward(model, **diffusers_inputs)` for diffusers' argument names (docs/checkpoint.md).
"""


def __getattr__(name: str):  # lazy: `h3core.model.config` stays importable without torch
    if name == "load_transformer":
        from h3core.model.checkpoint import load_transformer

        return load_transformer
    raise AttributeError(f"module 'h3core.model' has no attribute {name!r}")
