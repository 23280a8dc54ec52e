"""Device policy with CUDA absent (this machine has none; CUDA is also mocked away explicitly)."""

import pytest
import torch

from h3core.errors import BackendUnavailable, ConfigError
from h3core.runtime import device


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(device, "visible_gpu_count", lambda: 2)


def test_auto_is_cpu_without_cuda(no_cuda):
    assert device.resolve_device("auto") == "cpu"
    assert device.resolve_device("CPU") == "cpu"


def test_cuda_without_cuda_is_one_clear_line(no_cuda):
    with pytest.raises(BackendUnavailable) as err:
        device.resolve_device("cuda")
    message = str(err.value)
    assert "\n" not in message and "--device cpu" in message and err.value.exit_code == 2


def test_auto_picks_cuda_when_a_gpu_is_visible(two_gpus):
    assert device.resolve_device("auto") == "cuda"
    assert device.resolve_device("cuda") == "cuda"


def test_unknown_device_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown device 'tpu'"):
        device.resolve_device("tpu")


def test_dtype_policy():
    assert device.compute_dtype("cuda") is torch.bfloat16
    assert device.compute_dtype("cpu") is torch.float32
    assert device.compute_dtype("cpu", "bf16") is torch.bfloat16
    assert device.compute_dtype("cuda", "fp32") is torch.float32
    assert device.compute_dtype("cuda", "FP16") is torch.float16
    with pytest.raises(ConfigError, match="--dtype 'fp8': is not a dtype h3 computes in"):
        device.compute_dtype("cpu", "fp8")


def test_dtype_names_round_trip():
    for name in device.DTYPES:
        assert device.dtype_name(device.compute_dtype("cpu", name)) == name


def test_world_size_fits(no_cuda):
    device.check_world_size_fits(8, "cpu")  # Gloo ranks: any count
    with pytest.raises(ConfigError, match="only 0 GPU"):
        device.check_world_size_fits(1, "cuda")
    with pytest.raises(ConfigError, match="at least 1"):
        device.check_world_size_fits(0, "cpu")


def test_world_size_above_visible_gpus(two_gpus):
    device.check_world_size_fits(2, "cuda")
    with pytest.raises(ConfigError, match="4 ranks asked for but only 2 GPU"):
        device.check_world_size_fits(4, "cuda")


def test_rank_device_pins_local_rank():
    assert device.rank_device("cuda", 3) == torch.device("cuda", 3)
    assert device.rank_device("cpu", 3) == torch.device("cpu")


def test_threads_per_rank_never_zero():
    assert device.cpu_threads_per_rank(10_000) == 1
    assert device.cpu_threads_per_rank(1) >= 1


def test_nccl_environment_fails_fast():
    env = device.nccl_environment(30)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert int(env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"]) >= 60


def test_stopwatch_on_cpu_measures_the_region():
    with device.Stopwatch("cpu") as watch:
        sum(range(200_000))
    assert 0 < watch.seconds < 5
    device.synchronize("cpu")  # a no-op, must not raise


def test_cpu_peak_memory_sees_a_large_allocation():
    device.reset_peak_memory("cpu")
    before = device.peak_memory_bytes("cpu")
    block = torch.ones(64 * 1024 * 1024, dtype=torch.uint8)  # 64 MiB, touched
    after = device.peak_memory_bytes("cpu")
    del block
    assert after - before >= 60 * 1024 * 1024
    assert "resident" in device.peak_memory_kind("cpu")
    assert device.peak_memory_kind("cuda") == "torch.cuda.max_memory_allocated"


def test_multi_node_torchrun_counts_only_this_machines_ranks_against_its_gpus(two_gpus, monkeypatch):
    """Two machines of 2 GPUs: WORLD_SIZE=4, LOCAL_WORLD_SIZE=2 fits; 3 local ranks do not."""
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    device.check_world_size_fits(4, "cuda")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"3 ranks asked for on this machine \(LOCAL_WORLD_SIZE=3 of WORLD_SIZE=4\) but only 2 GPU"):
        device.check_world_size_fits(4, "cuda")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # LOCAL_RANK 1 cannot be on a machine of one process
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE=1 with LOCAL_RANK=1 and WORLD_SIZE=4: not a valid torchrun launch"):
        device.check_world_size_fits(4, "cuda")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # a launcher without it: the whole world is on this machine
    with pytest.raises(ConfigError, match="4 ranks asked for on this machine"):
        device.check_world_size_fits(4, "cuda")
