"""`h3 generate` as a user runs it: in this process (`h3` fixture, CliRunner), and as a real process
where the contract is about one (the README's first command; no worker survives a failed process)."""

import json
import time
import uuid

import pytest
from typer.testing import CliRunner

from commands import h3_process, no_survivors, one_line
from h3cli.main import app
from h3core.generate.report import RunReport

runner = CliRunner()


def test_main_command_writes_report_latents_and_preview(tmp_path, cache):
    start = time.monotonic()
    proc = h3_process("generate", "--prompt", "a red fox in snow", "--output", str(tmp_path / "run"), env={"H3_CACHE_DIR": cache})
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    assert "weights: synthetic" in proc.stdout
    report = RunReport.model_validate_json((tmp_path / "run" / "report.json").read_text())
    assert report.weights == "synthetic" and report.world_size == 1 and report.video is not None
    assert (tmp_path / "run" / "latents.safetensors").stat().st_size > 0
    assert (tmp_path / "run" / "preview.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["latents.safetensors", "preview.png", "report.json", "video.mp4"]
    d = report.decode
    assert d is not None and d.problems == [] and d.weights == "synthetic" and report.files.video == str(tmp_path / "run" / "video.mp4")
    assert (d.probe.video_codec, d.probe.frames, d.probe.audio_codec, d.probe.channels) == ("h264", report.shape.frames, "aac", 2)
    assert d.latents["video"] == report.video and d.latents["audio"] == report.audio  # the latents it wrote are the ones it decoded
    assert elapsed < 120  # generous: the README promises under a minute on 2 quiet cores
    # where the minutes went (issue 35.7): every stage measured, none negative, together the wall time
    w = report.wall
    assert w is not None and w.start is not None and w.start > 0 and "vaes" in w.load and w.decode > 0 and w.write > 0
    stages = w.start + w.resolve + w.ranks_start + sum(w.load.values()) + w.text + w.denoise + w.parity + w.decode + w.write
    assert min(w.resolve, w.ranks_start, w.text, w.denoise, *w.load.values()) >= 0
    assert abs(stages - w.total) < 0.05 * w.total and w.total <= elapsed
    assert w.denoise == pytest.approx(report.timings["sampling"] + report.timings["gather"])
    assert "wall time" in proc.stdout
    # `h3 decode` of the saved latents is the same clip, labelled by the latents' own metadata
    decode = h3_process("decode", str(tmp_path / "run" / "latents.safetensors"), "-o", str(tmp_path / "again"), "--json", env={"H3_CACHE_DIR": cache})
    assert decode.returncode == 0, decode.stderr
    again = json.loads(decode.stdout)
    assert again["latents_metadata"]["weights"] == "synthetic" and again["decode"]["weights"] == "synthetic"
    assert again["decode"]["decoded"] == d.model_dump(mode="json")["decoded"]
    assert (tmp_path / "again" / "video.mp4").read_bytes() == (tmp_path / "run" / "video.mp4").read_bytes()


def test_no_decode_writes_the_latents_and_their_preview(tmp_path, cache):
    out = tmp_path / "run"
    result = runner.invoke(app, ["generate", "--steps", "2", "--no-decode", "--output", str(out)], env={"H3_CACHE_DIR": cache})
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["latents.safetensors", "preview.png", "report.json"]
    report = RunReport.model_validate_json((out / "report.json").read_text())
    assert report.decode is None and report.files.video is None


def _checksums(args, tmp_path, cache):
    out = tmp_path / uuid.uuid4().hex
    result = runner.invoke(app, ["generate", "--json", "--steps", "2", "--no-decode", "--output", str(out), *args], env={"H3_CACHE_DIR": cache})
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    return data["video"]["sha256"], data["audio"]["sha256"]


def test_same_seed_same_latents_different_seed_different(tmp_path, cache):
    a = _checksums(["--seed", "1"], tmp_path, cache)
    assert a == _checksums(["--seed", "1"], tmp_path, cache)
    assert a[0] != _checksums(["--seed", "2"], tmp_path, cache)[0]


def test_save_latents_off_writes_the_report_only(tmp_path, cache):
    out = tmp_path / "run"
    result = runner.invoke(app, ["generate", "--steps", "2", "--parity", "--output", str(out)], env={"H3_CACHE_DIR": cache, "H3_SAVE_LATENTS": "0"})
    assert result.exit_code == 0, result.output
    assert not (out / "latents.safetensors").exists()
    report = RunReport.model_validate_json((out / "report.json").read_text())
    assert report.files.latents is None
    assert report.parity.bitwise and "identity path" in report.parity.reference  # --parity at one rank: vs the other mode


def test_benchmark_env_writes_a_copy_of_the_report(tmp_path, cache):
    bench = tmp_path / "bench.json"
    result = runner.invoke(app, ["generate", "--steps", "2", "--output", str(tmp_path / "run")], env={"H3_CACHE_DIR": cache, "H3_DISTRIBUTED_BENCHMARK": str(bench)})
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
        (["ulysses", "4", "--cfg-parallel"], "--cfg-parallel needs guidance: give --guidance > 1"),
        (["ulysses", "3", "--cfg-parallel", "--guidance", "3"], "3 is odd: give an even rank count"),
        (["tensor", "18", "--cfg-parallel", "--guidance", "3"], "8 attention heads over 9 ranks"),
        (["ulysses", "4", "--replicas", "2"], "--replicas 2 runs independent groups that share the prompts of --prompts FILE out"),
        (["ulysses", "3", "--replicas", "2", "--prompts", "PROMPTS"], "3 ranks do not split into 2 replica groups"),
        (["--video-vae", "/nonexistent/vae.safetensors"], "--video-vae"),
        (["--audio-vae", "PROMPTS"], "--audio-vae"),
    ],
)
def test_user_errors_are_one_line_exit_2_and_write_nothing(h3, tmp_path, args, needle):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a fox\n")
    code, _, err = h3("generate", "--output", str(tmp_path / "run"), *(str(prompts) if a == "PROMPTS" else a for a in args))
    assert code == 2, err
    assert needle in one_line(err)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("action", ["raise", "kill"])
def test_a_failing_rank_stops_the_run_with_its_error_and_no_survivors(h3, tmp_path, cache, monkeypatch, action):
    """`raise` in this process; `kill` as a real process (no worker may outlive the h3 process)."""
    marker = f"H3_TEST_MARKER_{uuid.uuid4().hex}"
    env = {"H3_CACHE_DIR": cache, "H3_INJECT_FAULT": f"step:1@1:{action}", marker: "1"}
    args = ("generate", "tensor", "2", "--steps", "3", "--output", str(tmp_path / "run"))
    start = time.monotonic()
    if action == "kill":
        proc = h3_process(*args, env=env)
        code, err = proc.returncode, proc.stderr
    else:
        for name, value in env.items():
            monkeypatch.setenv(name, value)  # the spawned ranks inherit it
        code, _, err = h3(*args)
    assert code == 1, err
    assert "rank 1" in one_line(err)
    assert not (tmp_path / "run").exists()  # no report written as if successful
    assert time.monotonic() - start < 120
    assert no_survivors(marker)


def test_a_real_qwen3_text_encoder_is_used_and_named_in_the_report(h3, tmp_path, cache):
    from qwen3_checkpoints import comfy_names, qwen3_vl_model, write_file

    # ComfyUI's layout of a tiny Qwen3-VL cut after 2 layers (H3's file is cut after 50): its output layer
    path = write_file(tmp_path / "qwen3vl_comfy.safetensors", comfy_names(qwen3_vl_model(seed=1), 2))
    result = runner.invoke(app, ["generate", "--steps", "2", "--json", "--output", str(tmp_path / "run")], env={"H3_CACHE_DIR": cache, "H3_TEXT_ENCODER_PATH": str(path)})
    assert result.exit_code == 0, result.output
    encoder = json.loads(result.stdout)["text_encoder"]
    assert (encoder["kind"], encoder["path"], encoder["layers"]) == ("comfy", str(path), 2) and encoder["bytes_read"] > 0
    code, _, err = h3("generate", "--steps", "2", "--text-encoder", str(tmp_path / "missing"), "--gpus", "2")
    assert code == 2 and "text encoder not found" in err and "rank" not in err


def test_profile_splits_every_step_of_every_rank(tmp_path, cache):
    result = runner.invoke(app, ["generate", "ulysses", "2", "--preset", "narrow", "--steps", "3", "--profile", "--no-save-latents",
                                 "--no-decode", "--device", "cpu", "--output", str(tmp_path / "run")], env={"H3_CACHE_DIR": cache, "COLUMNS": "160"})
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


def test_the_header_counts_the_weights_of_a_checkpoint_folder_not_its_directory_entry(h3, tmp_path, cache):
    """A folder of shards (the official layout) is a path whose own `st_size` is some 4,096 bytes: the
    header says the bytes of the tensors it holds."""
    from safetensors.torch import load_file

    from h3_reference import write_sharded
    from h3core.model.config import preset
    from h3core.model.synthetic import synthetic_checkpoint

    path, _ = synthetic_checkpoint(preset("tiny"), seed=0, directory=tmp_path / "cache")
    tensors = {k: v.clone() for k, v in load_file(str(path)).items()}
    folder = write_sharded(tmp_path / "official", tensors)
    weights = sum(t.numel() * t.element_size() for t in tensors.values())
    code, out, err = h3("generate", "--model", str(folder), "--preset", "tiny", "--no-decode", "--no-save-latents", "--json", "-o", str(tmp_path / "run"))
    assert code == 0, err
    assert json.loads(out)["weights"] == f"{folder} ({weights:,} bytes of weights)"
