"""NVFP4: the one place that knows the weight format (see docs/nvfp4.md and ../shared/NVFP4.md).

`layout` is pure Python (block geometry, byte and scale-column arithmetic) so that the partition
module can use it without importing torch; this package's `__init__` stays torch-free for the same
reason. The torch parts are submodules:

- `codec`   E2M1 codes, nibble packing, `NVFP4Weight`, `quantize` / `dequantize`, global scales
- `swizzle` the 128x4 block-scale layout Blackwell GEMMs read (built in memory at load time)
- `matmul`  the matmul paths (cpu-dequant, cpu-fp4-emulated, cuda-dequant-bf16, cuda-fp4-scaled-mm), the choice, the record of what ran
- `activation` the fp4 paths' activation quantizer: eager (reference) and fused (`fused_kernel`, Triton); quantize-before-gather
- `selftest` the fp4 GEMM self-test with values, in a child process
- `kernels` `DeviceKernels`: what a device runs (capability, cuDNN, the self-test's verdict, the fused
            quantizer, the decode's lookup tables), what `NVFP4Linear` and the SDPA rule ask
- `linear`  `NVFP4Linear`, buffers named as ModelOpt names them
- `shard`   layout-preserving row / column shards (ranges from `h3core.parallel.partition`)
- `io`      safetensors with ModelOpt names, lazy row / column slices from disk
- `comfy`   ComfyUI / comfy-kitchen files: hi-first codes and swizzled scales converted at load,
            `comfy_quant` markers, int8_tensorwise rows
"""
