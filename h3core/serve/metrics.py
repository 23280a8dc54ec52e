"""`GET /metrics`: Prometheus' text format (version 0.0.4), written out here: a dozen lines do not
need a client library and its process-wide registry (a second server in one process, a test, would
share it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from h3core.serve.engine import ServerState


def render_metrics(state: "ServerState") -> str:
    counts, m = state.queue.counts(), state.metrics
    out: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(f"{name}{labels} {value:g}" for labels, value in samples)

    metric("h3_up", "gauge", "1 while the server takes jobs (phase label: ok, loading, stopping, failed).", [(f'{{phase="{state.phase}"}}', 1.0 if state.phase == "ok" else 0.0)])
    metric("h3_queue_depth", "gauge", "Jobs queued, not yet running.", [("", counts["queued"])])
    metric("h3_jobs", "gauge", "Jobs in the state directory by status (deleted ones included).", [(f'{{status="{s}"}}', n) for s, n in counts.items()])
    metric("h3_running_jobs", "gauge", "Jobs the ranks hold now (one per busy replica group).", [("", len(state.running))])
    metric("h3_step_seconds", "summary", "Denoising steps of finished jobs (replica group leads' wall time).", [("_sum", m.step_seconds), ("_count", m.steps)])
    metric("h3_denoise_seconds_total", "counter", "Sampling time of finished jobs.", [("", m.denoise_seconds)])
    metric("h3_decode_seconds_total", "counter", "VAE decode and mp4 time of finished jobs.", [("", m.decode_seconds)])
    metric("h3_jobs_completed_total", "counter", "Jobs this server completed since it started.", [("", m.jobs_done)])
    metric("h3_load_seconds", "gauge", "Starting the ranks and loading the denoiser, text encoder and VAEs (the last start).", [("", m.load_seconds)])
    metric("h3_rank_peak_memory_bytes", "gauge", "Each rank's peak device memory while sampling (GPU on CUDA ranks), highest seen.",
           [(f'{{rank="{rank}"}}', peak) for rank, peak in sorted(m.rank_peak_bytes.items())])
    metric("h3_decode_peak_memory_bytes", "gauge", "The decode's peak device memory, highest seen.", [("", m.decode_peak_bytes)])
    gpu = _gpu_memory()
    if gpu:
        metric("h3_gpu_memory_allocated_bytes", "gauge", "GPU memory this (the server's) process holds now.", gpu)
    return "\n".join(out) + "\n"


def _gpu_memory() -> list[tuple[str, float]]:
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    return [(f'{{device="cuda:{i}"}}', torch.cuda.memory_allocated(i)) for i in range(torch.cuda.device_count())]
