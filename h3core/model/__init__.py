"""The H3 model (DESIGN.md §2), knowing nothing about parallelism.

- `config`      `ModelConfig`, the named presets, and the latent/patch arithmetic
- `sequence`    the packed sequence's layout: `text | video | audio` segments (torch-free)
- `dit`         the denoiser (`H3Model`), its inputs (`PackedSequence`, RoPE, patches), and the
                declaration of which linears tensor mode splits (`TENSOR_PARALLEL`)
- `attention`   the attention backends and the record of the kernels that ran
- `sampler`     the rectified-flow Euler sampler (no model inside)
- `checkpoint`  the checkpoint contract and the loader
- `synthetic`   the embedded synthetic checkpoint: writer, calibration, cache
"""
