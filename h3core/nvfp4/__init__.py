"""NVFP4: the one place that knows the weight format (see docs/nvfp4.md and ../shared/NVFP4.md).

`layout` is pure Python (block geometry, byte and scale-column arithmetic) so that the partition
module can use it without importing torch. The torch parts live in the other submodules.
"""
