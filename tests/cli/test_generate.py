"""`h3 generate` as a user runs it: real processes for faults and errors, CliRunner for the rest."""

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from h3cli.main import app
from h3core.parity import tolerance
from h3core.pipeline import RunReport
from h3core.plan import Mode

runner = CliRunner()


def h3(*args, env=None, cwd=None, timeout=300):
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "h3cli.main", *args], capture_output=True, text=True, env=full_env, cwd=cwd, timeout=timeout)


def _survivors(marker: str) -> list[int]:
    """Processes whose environment carries `marker` (workers of a run that should be gone)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return {"H3_CACHE_DIR": str(tmp_path_factory.mktemp("cache"))}


def test_main_command_writes_report_latents_and_preview(tmp_path, cache):
    start = time.monotonic()
    proc = h3("generate", "--prompt", "a red fox in snow", "--output", str(tmp_path / "run"), env=cache)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    assert "weights: synthetic" in proc.stdout
    report = RunReport.model_validate_json((tmp_path / "run" / "report.json").read_text())
    assert report.weights == "synthetic" and report.world_size == 1 and report.video is not None
    assert (tmp_path / "run" / "latents.safetensors").stat().st_size > 0
    assert (tmp_path / "run" / "preview.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["latents.safetensors", "preview.png", "report.json"]
    assert elapsed < 120  # generous: the README promises under a minute on 2 quiet cores


def _checksums(args, tmp_path, cache):
    out = tmp_path / uuid.uuid4().hex
    result = runner.invoke(app, ["generate", "--json", "--steps", "2", "--output", str(out), *args], env=cache)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    return data["video"]["sha256"], data["audio"]["sha256"]


def test_same_seed_same_latents_different_seed_different(tmp_path, cache):
    a = _checksums(["--seed", "1"], tmp_path, cache)
    assert a == _checksums(["--seed", "1"], tmp_path, cache)
    assert a[0] != _checksums(["--seed", "2"], tmp_path, cache)[0]


def test_save_latents_off_writes_the_report_only(tmp_path, cache):
    out = tmp_path / "run"
    result = runner.invoke(app, ["generate", "--steps", "1", "--output", str(out)], env={**cache, "H3_SAVE_LATENTS": "0"})
    assert result.exit_code == 0, result.output
    assert not (out / "latents.safetensors").exists()
    report = RunReport.model_validate_json((out / "report.json").read_text())
    assert report.files.latents is None


def test_benchmark_env_writes_a_copy_of_the_report(tmp_path, cache):
    bench = tmp_path / "bench.json"
    result = runner.invoke(app, ["generate", "--steps", "1", "--output", str(tmp_path / "run")], env={**cache, "H3_DISTRIBUTED_BENCHMARK": str(bench)})
    assert result.exit_code == 0, result.output
    assert RunReport.model_validate_json(bench.read_text()).command == "generate"


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--gpus", "57", "--preset", "narrow"], "56 attention heads over 57 ranks"),
        (["--attention", "sage2"], "sageattention"),
        (["--attention", "magic"], "unknown attention backend"),
        (["--model", "/nonexistent/h3.safetensors"], "H3 checkpoint not found"),
        (["diagonal"], "first argument is the mode"),
        (["tensor", "2", "--gpus", "4"], "given twice"),
        (["--width", "100"], "not a multiple of 32"),
        (["--device", "cuda"], "CUDA"),
    ],
)
def test_user_errors_are_one_line_exit_2_and_write_nothing(tmp_path, cache, args, needle):
    proc = h3("generate", "--output", str(tmp_path / "run"), *args, env=cache)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("action", ["raise", "kill"])
def test_a_failing_rank_stops_the_run_with_its_error_and_no_survivors(tmp_path, cache, action):
    marker = f"H3_TEST_MARKER_{uuid.uuid4().hex}"
    env = {**cache, "H3_INJECT_FAULT": f"step:1@1:{action}", marker: "1"}
    start = time.monotonic()
    proc = h3("generate", "tensor", "2", "--steps", "3", "--output", str(tmp_path / "run"), env=env)
    assert proc.returncode == 1, proc.stderr
    assert "rank 1" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()  # no report written as if successful
    assert time.monotonic() - start < 120
    deadline = time.monotonic() + 10
    while _survivors(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _survivors(marker) == []


def test_tensor_mode_on_six_ranks_with_ragged_heads_matches_one_rank(tmp_path, cache):
    # guidance with a negative prompt of another length: the latent rows are re-split between the
    # two sequences' partitions every step (repartition_rows)
    proc = h3(
        "generate", "--mode", "tensor", "--gpus", "6", "--preset", "narrow", "--steps", "2", "--parity", "--json",
        "--guidance", "3", "--negative-prompt", "blurry", "--output", str(tmp_path / "run"), env=cache,
    )
    assert proc.returncode == 0, proc.stderr
    report = RunReport.model_validate_json(proc.stdout)
    assert report.partition.heads == [10, 10, 9, 9, 9, 9]
    assert report.ranks_on == "6 CPU ranks (Gloo)"
    assert report.parity.passed and report.parity.tolerance == tolerance(Mode.TENSOR, torch.float32)
    for rank in report.ranks:  # what every rank really ran in the loop: fused attention, the CPU's NVFP4 path
        assert rank.attention_kernels.keys() == {"sdpa:flash_attention"} and rank.nvfp4_paths.keys() == {"cpu-dequant"}
    assert (report.attention_kernel, report.nvfp4_path) == ("sdpa:flash_attention", "cpu-dequant")
    assert report.comm_total.kinds["repartition_rows"].calls > 0
    full = report.ranks[0].weights.block_linears_full
    # No rank holds more than its partition share (heads for QKV/Out, NVFP4 blocks for FC1/FC2), and
    # together they hold the block linears once (plus the replicated Out/FC2 biases).
    fc_blocks = [c.scale_columns.stop - c.scale_columns.start for c in (r.tensor.fc2_columns for r in report.partition.ranks)]
    for rank, heads, blocks in zip(report.ranks, report.partition.heads, fc_blocks):
        share = max(heads / 56, blocks / sum(fc_blocks))
        assert rank.weights.block_linears_resident <= 1.05 * share * full
        assert rank.weights.block_linears_read <= 1.05 * share * full
    assert sum(r.weights.block_linears_resident for r in report.ranks) <= 1.02 * full


def test_a_real_qwen3_text_encoder_is_used_and_named_in_the_report(tmp_path, cache):
    from qwen3_checkpoints import plain_names, qwen3_config_json, random_qwen3_state, train_tokenizer, write_checkpoint

    folder = write_checkpoint(
        tmp_path / "qwen3",
        plain_names(random_qwen3_state(seed=1)),
        config=qwen3_config_json(),
        tokenizer=train_tokenizer(tmp_path / "tokenizer.json"),
    )
    result = runner.invoke(app, ["generate", "--steps", "1", "--json", "--output", str(tmp_path / "run")], env={**cache, "H3_TEXT_ENCODER_PATH": str(folder)})
    assert result.exit_code == 0, result.output
    encoder = json.loads(result.stdout)["text_encoder"]
    assert encoder["kind"] == "qwen3" and encoder["path"] == str(folder) and encoder["bytes_read"] > 0
    proc = h3("generate", "--steps", "1", "--text-encoder", str(tmp_path / "missing"), "--gpus", "2", env=cache)
    assert proc.returncode == 2 and "text encoder not found" in proc.stderr and "rank" not in proc.stderr


def test_profile_splits_every_step_of_every_rank(tmp_path, cache):
    result = runner.invoke(app, ["generate", "ulysses", "2", "--preset", "narrow", "--steps", "2", "--profile", "--no-save-latents",
                                 "--device", "cpu", "--output", str(tmp_path / "run")], env={**cache, "COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    assert "where a step goes" in result.output and "seq to head" in result.output
    report = RunReport.model_validate_json((tmp_path / "run" / "report.json").read_text())
    profile = report.profile
    assert [r.rank for r in profile.ranks] == [0, 1] and all(len(r.steps) == 2 for r in profile.ranks)
    for rank in profile.ranks:
        for split in rank.steps:
            parts = sum(v for k, v in split.items() if k != "step")
            assert abs(parts - split["step"]) < 1e-9 and split["rest"] > 0
            assert split["attention"] > 0 and split["nvfp4_linears"] > 0 and split["seq_to_head"] > 0 and split["head_to_seq"] > 0
    # the profiled step is the step the report times (same region, slowest rank)
    assert max(r.steps[1]["step"] for r in profile.ranks) <= report.step_seconds[1] * 1.01
    assert report.cpu_allocator in ("retain", "system")
