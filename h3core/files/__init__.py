"""Files: what h3 reads and writes on disk, below every command.

- `paths`        file-system facts in words (what a path is, why an OSError happened, free space)
- `atomic`       the one atomic writer: a temp file beside the target, synced, renamed over it
- `safetensors`  a lazy reader of safetensors files (whole tensors, row and column ranges) and the writer
"""
