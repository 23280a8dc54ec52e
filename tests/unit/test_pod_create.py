"""Create planning, data-center choice, key files and access lines (against the fake RunPod server)."""

from __future__ import annotations

import os

import pytest
from runpod_fake import SERVER_EDITION, TEST_KEY, WORKSTATION_EDITION

from h3core.errors import ConfigError, NoCapacity
from h3core.pod import (
    Availability,
    Catalog,
    Cloud,
    CreateOptions,
    DataCenterStock,
    RetryPolicy,
    RunPodClient,
    choose_datacenter,
    plan_create,
    pod_access,
    read_public_key,
)
from h3core.pod.models import Pod

PUBLIC_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGh3dGVzdGtleWgzdGVzdGtleWgzdGVzdGtleQ h3@test"


@pytest.fixture
def client(runpod) -> RunPodClient:
    return RunPodClient(TEST_KEY, runpod.base_url, retry=RetryPolicy(backoff_s=0), sleep=lambda s: None)


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "id_ed25519.pub"
    path.write_text(PUBLIC_KEY + "\n")
    return path


def _catalog(*stock: tuple[str, str]) -> Catalog:
    data_centers = [DataCenterStock(id=i, name=i, availability=Availability(a)) for i, a in stock]
    data_centers.sort(key=lambda dc: (-dc.availability.rank, dc.id))
    return Catalog(gpu_type=SERVER_EDITION, gpu_name="RTX PRO 6000", memory_gb=96, count=8, cloud=Cloud.SECURE,
                   min_cuda="13.0", price_per_gpu_hour=1.89, max_count=8, availability=Availability.HIGH,
                   data_centers=data_centers, cuda_versions=[])


# --- data-center choice -------------------------------------------------------------------------------


def test_choice_takes_the_most_stock_and_says_why():
    choice = choose_datacenter(_catalog(("US-KS-2", "MEDIUM"), ("EUR-IS-1", "HIGH"), ("US-TX-3", "LOW"), ("X-1", "NONE")))
    assert choice.id == "EUR-IS-1" and choice.availability is Availability.HIGH
    assert choice.reason == (
        "EUR-IS-1: picked automatically, highest stock (HIGH) of 3 data centers in stock; others: US-KS-2 MEDIUM, US-TX-3 LOW"
    )


def test_choice_breaks_ties_by_id_and_names_a_lone_candidate():
    assert choose_datacenter(_catalog(("US-KS-2", "HIGH"), ("EUR-IS-1", "HIGH"))).id == "EUR-IS-1"
    assert "the only data center in stock (LOW)" in choose_datacenter(_catalog(("US-KS-2", "LOW"))).reason


def test_choice_with_nothing_in_stock_stops_with_one_line():
    with pytest.raises(NoCapacity) as err:
        choose_datacenter(_catalog(("US-KS-2", "NONE")))
    assert str(err.value).startswith(f"no stock for 8 x {SERVER_EDITION} on SECURE (hosts with CUDA >= 13.0) in any data center")
    assert "h3 pod catalog" in str(err.value)


def test_choice_honours_an_explicit_datacenter_and_a_volume_datacenter():
    catalog = _catalog(("US-KS-2", "LOW"), ("EUR-IS-1", "HIGH"))
    assert choose_datacenter(catalog, "US-TX-3").availability is Availability.NONE  # asked for: kept, stock NONE
    assert choose_datacenter(catalog, required="US-KS-2").id == "US-KS-2"
    with pytest.raises(ConfigError, match="use --datacenter US-KS-2"):
        choose_datacenter(catalog, "EUR-IS-1", required="US-KS-2")
    with pytest.raises(NoCapacity, match="in EUR-RO-1 .the network volume's data center."):
        choose_datacenter(catalog, required="EUR-RO-1")


# --- the create plan (reads only) ------------------------------------------------------------------------


def test_default_plan_is_the_seeds_pod_in_the_best_data_center(client, runpod):
    plan = plan_create(client, CreateOptions.build())
    body = plan.request.body()
    assert body == {
        "name": "h3-8gpu",
        "image": "runpod/pytorch:1.0.3-cu1300-torch291-ubuntu2404",
        "gpu": {"id": SERVER_EDITION, "count": 8, "minCudaVersion": "13.0"},
        "cloud": "SECURE",
        "dataCenterIds": ["EUR-IS-1"],
        "disk": 50,
        "ports": ["22/tcp"],
        "env": {},
        "mounts": {"persistent": {"size": 100, "path": "/workspace"}},
        "startSsh": True,
    }
    assert runpod.spec.body_errors(runpod.spec.route("POST", "/v2/pods")[1], body) == []
    assert plan.price_per_hour == pytest.approx(15.12) and plan.warnings == []
    assert "highest stock (HIGH)" in plan.datacenter.reason
    assert runpod.sent("POST") == [] and runpod.sent("DELETE") == []


def test_plan_puts_the_key_file_in_public_key_and_mounts_a_network_volume(client, runpod, key_file):
    options = CreateOptions.build(count=2, network_volume="vol1234567", mount_path="/runpod-volume", ssh_public_key=key_file)
    plan = plan_create(client, options)
    body = plan.request.body()
    assert body["env"] == {"PUBLIC_KEY": PUBLIC_KEY}
    assert body["mounts"] == {"network": [{"volumeId": "vol1234567", "path": "/runpod-volume"}]}
    assert body["dataCenterIds"] == ["US-KS-2"]  # the volume's data center, not EUR-IS-1 with more stock
    assert body["gpu"] == {"id": SERVER_EDITION, "count": 2, "minCudaVersion": "13.0"}
    assert "the network volume's data center" in plan.datacenter.reason
    assert runpod.spec.body_errors(runpod.spec.route("POST", "/v2/pods")[1], body) == []
    assert "/v2/account/ssh-keys" not in [r.path for r in runpod.requests]  # a key file makes the lookup moot


def test_plan_options_reach_the_body(client, key_file):
    options = CreateOptions.build(count=1, datacenter="US-KS-2", cloud=Cloud.SECURE, image="me/h3:1", name="bench",
                                  disk_gb=80, volume_gb=300, mount_path="/data", min_cuda=None)
    body = plan_create(client, options).request.body()
    assert body["gpu"] == {"id": SERVER_EDITION, "count": 1}
    assert (body["name"], body["image"], body["disk"], body["dataCenterIds"]) == ("bench", "me/h3:1", 80, ["US-KS-2"])
    assert body["mounts"] == {"persistent": {"size": 300, "path": "/data"}}


def test_plan_warns_about_an_out_of_stock_choice_and_missing_ssh_keys(client, runpod):
    runpod.ssh_keys.clear()
    plan = plan_create(client, CreateOptions.build(datacenter="US-TX-3"))
    assert len(plan.warnings) == 2
    assert "no SSH key registered" in plan.warnings[0] and "--ssh-public-key" in plan.warnings[0]
    assert "no stock" in plan.warnings[1] and "US-TX-3" in plan.warnings[1]


def test_plan_warns_when_the_account_keys_cannot_be_read(client, runpod):
    runpod.script("GET", "/v2/account/ssh-keys", 403, {"title": "Forbidden", "status": 403, "detail": "access denied"})
    (warning,) = plan_create(client, CreateOptions.build()).warnings
    assert warning.startswith("could not read the account's SSH keys (RunPod account SSH keys failed: HTTP 403 Forbidden")
    assert warning.endswith("pass --ssh-public-key to be sure of SSH access")


def test_plan_with_no_stock_anywhere_stops(client, runpod):
    with pytest.raises(NoCapacity, match="no stock for 8 x NVIDIA RTX PRO 6000 Blackwell Workstation Edition"):
        plan_create(client, CreateOptions.build(gpu_type=WORKSTATION_EDITION))
    assert runpod.sent("POST") == []


def test_plan_refuses_more_gpus_than_one_machine_has(client):
    with pytest.raises(ConfigError, match="--count 16 exceeds the largest SECURE machine .* .8 GPUs."):
        plan_create(client, CreateOptions.build(count=16))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"network_volume": "vol1", "volume_gb": 50}, "--volume-gb (persistent storage) and --network-volume exclude each other"),
        ({"volume_gb": 5}, "--volume-gb 5: must be at least 10"),
        ({"disk_gb": 0}, "--disk 0: must be at least 1"),
        ({"mount_path": "workspace"}, "--volume-mount-path 'workspace': string should match pattern"),
        ({"count": 0}, "--count 0: must be at least 1"),
        ({"network_volume": "../v2/pods"}, "--network-volume '../v2/pods': string should match pattern"),
    ],
)
def test_bad_options_are_one_line_config_errors(values, message):
    with pytest.raises(ConfigError) as err:
        CreateOptions.build(**values)
    assert message in str(err.value) and "\n" not in str(err.value)


# --- key files ------------------------------------------------------------------------------------------


def test_public_key_file_is_read_and_checked(tmp_path, key_file):
    assert read_public_key(key_file) == PUBLIC_KEY
    two = tmp_path / "two.pub"
    two.write_text(f"# mine\n{PUBLIC_KEY}\n\necdsa-sha2-nistp256 AAAAE2VjZHNh other\n")
    assert read_public_key(two) == f"{PUBLIC_KEY}\necdsa-sha2-nistp256 AAAAE2VjZHNh other"


def test_private_missing_unreadable_or_garbage_key_files_are_refused(tmp_path):
    private = tmp_path / "id_ed25519"
    private.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEA\n-----END OPENSSH PRIVATE KEY-----\n")
    with pytest.raises(ConfigError, match="is a PRIVATE key; pass the matching public key"):
        read_public_key(private)
    with pytest.raises(ConfigError, match="cannot read --ssh-public-key .*a part of the path does not exist"):
        read_public_key(tmp_path / "absent.pub")
    garbage = tmp_path / "notes.pub"
    garbage.write_text("hello world\n")
    with pytest.raises(ConfigError, match="not an OpenSSH public key"):
        read_public_key(garbage)
    if os.geteuid() != 0:  # root reads anything
        locked = tmp_path / "locked.pub"
        locked.write_text(PUBLIC_KEY)
        locked.chmod(0)
        with pytest.raises(ConfigError, match="cannot read --ssh-public-key .*permission denied"):
            read_public_key(locked)


# --- access lines --------------------------------------------------------------------------------------


def test_access_lines_for_a_running_pod(runpod):
    pod = Pod.model_validate(runpod.add_pod())
    access = pod_access(pod)
    assert access.ssh == "ssh -p 40022 root@203.0.113.7"
    assert access.rsync_checkout == "rsync --protect-args -e 'ssh -p 40022' -azP '--filter=:- .gitignore' ./ root@203.0.113.7:/workspace/h3/"
    assert access.rsync_checkpoints == (
        'rsync --protect-args -e \'ssh -p 40022\' -P "$H3_MODEL_PATH" "$H3_TEXT_ENCODER_PATH" "$H3_VIDEO_VAE_PATH" "$H3_AUDIO_VAE_PATH" '
        "root@203.0.113.7:/workspace/checkpoints/"
    )
    assert access.remote_env == {
        "H3_MODEL_PATH": "/workspace/checkpoints/minimax_h3_fl2va_pruned_nvfp4.safetensors",
        "H3_TEXT_ENCODER_PATH": "/workspace/checkpoints/qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors",
        "H3_VIDEO_VAE_PATH": "/workspace/checkpoints/minimax_h3_video_vae_fp16.safetensors",
        "H3_AUDIO_VAE_PATH": "/workspace/checkpoints/minimax_h3_audio_vae_fp32.safetensors",
    }
    assert access.note is None and access.proxy_ssh.startswith("ssh -p 22 pod")


def test_access_lines_follow_a_network_volume_path_and_wait_for_running(runpod):
    pod = runpod.add_pod(mounts={"network": [{"volumeId": "vol1234567", "path": "/runpod-volume"}]})
    pod.update(status="STARTING", ssh={**pod["ssh"], "direct": None})
    access = pod_access(Pod.model_validate(pod))
    assert access.ssh is None and access.rsync_checkout is None
    assert "no direct SSH endpoint yet (status STARTING)" in access.note
    assert access.remote_checkout == "/runpod-volume/h3"
    assert access.remote_env["H3_MODEL_PATH"].startswith("/runpod-volume/checkpoints/")
