"""`h3 pod ...` end to end against the fake RunPod server on 127.0.0.1.

Commands run through `h3cli.main.main` (the real error mapping), in process so retry waits and
timeouts can be made short; a few run as a real `h3` subprocess. Every run's stdout and stderr is
checked for the API key.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from dataclasses import dataclass

import pytest
from runpod_fake import SERVER_EDITION, TEST_KEY, WORKSTATION_EDITION, problem
from typer.testing import CliRunner

import h3core.pod.client as client_module
from commands import h3_process, run_main
from h3cli.main import app
from h3core.pod import RetryPolicy

PUBLIC_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGh3dGVzdGtleWgzdGVzdGtleWgzdGVzdGtleQ h3@test"


@dataclass
class Run:
    code: int
    out: str
    err: str

    def error_line(self) -> str:
        """The one error line (asserting there is exactly one and no traceback)."""
        errors = [line for line in self.err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in self.err, self.err
        return errors[0]


@pytest.fixture
def h3(runpod_env, capsys, monkeypatch):
    """Run `h3 ARGS...` in process; retries without waiting; asserts the key never shows."""
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("H3_DEBUG", raising=False)
    monkeypatch.setattr(client_module, "DEFAULT_RETRY", RetryPolicy(attempts=3, backoff_s=0))

    def run(*args: str) -> Run:
        code, out, err = run_main(capsys, *args)
        assert TEST_KEY not in out and TEST_KEY not in err
        return Run(code, out, err)

    return run


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "id_ed25519.pub"
    path.write_text(PUBLIC_KEY + "\n")
    return path


# --- catalog ---------------------------------------------------------------------------------------------


def test_catalog_table_lists_stock_best_first(h3, runpod):
    run = h3("pod", "catalog")
    assert run.code == 0, run.err
    assert f"8 x {SERVER_EDITION} on SECURE (hosts with CUDA >= 13.0)" in run.out
    assert "list $1.89/GPU/h = $15.12/h" in run.out and "overall HIGH" in run.out
    rows = [line.split("│")[1:4] for line in run.out.splitlines() if line.startswith("│") and "-" in line]
    assert [[c.strip() for c in row] for row in rows] == [
        ["EUR-IS-1", "Europe Iceland 1", "HIGH"], ["US-KS-2", "US Kansas 2", "MEDIUM"], ["US-TX-3", "US Texas 3", "NONE"]
    ]
    assert runpod.requests[0].query["count"] == "8"


def test_catalog_json_and_flags(h3, runpod):
    run = h3("pod", "catalog", "--count", "4", "--cloud", "community", "--min-cuda", "any", "--json")
    assert run.code == 0, run.err
    data = json.loads(run.out)
    assert data["count"] == 4 and data["cloud"] == "COMMUNITY" and data["min_cuda"] is None
    assert [dc["id"] for dc in data["data_centers"]] == ["EU-RO-1"] and data["price_per_hour"] == pytest.approx(6.36)
    assert runpod.requests[0].query == {"include": "AVAILABILITY", "product": "POD", "count": "4", "cloud": "COMMUNITY"}


def test_catalog_with_no_stock_says_so(h3):
    run = h3("pod", "catalog", "--gpu-type", WORKSTATION_EDITION)
    assert run.code == 0 and "no data center has 8 x this GPU in stock right now" in run.out


# --- create --------------------------------------------------------------------------------------------


def test_create_without_yes_shows_the_plan_and_sends_no_post(h3, runpod):
    run = h3("pod", "create", "--count", "8")
    assert run.code == 2
    assert run.out.startswith("would create (nothing sent):")
    assert "EUR-IS-1: picked automatically, highest stock (HIGH) of 2 data centers in stock; others: US-KS-2 MEDIUM" in run.out
    assert "$15.12/h list (8 x $1.89)" in run.out and "persistent 100 GB at /workspace" in run.out
    assert "22/tcp, startSsh, the account's registered SSH keys" in run.out
    assert run.error_line() == "error: nothing created: add --yes to create this pod (about $15.12/h while it exists)"
    assert runpod.sent("POST") == [] and runpod.pods == {}
    assert [r.path for r in runpod.requests] == [f"/v2/catalog/gpus/{SERVER_EDITION}", "/v2/account/ssh-keys"]


def test_create_json_without_yes_is_the_exact_body(h3, runpod, key_file):
    run = h3("pod", "create", "--datacenter", "US-KS-2", "--ssh-public-key", str(key_file), "--json")
    assert run.code == 2 and "add --yes" in run.error_line()
    data = json.loads(run.out)
    assert data["created"] is False and data["pod"] is None
    assert data["plan"]["request"]["env"] == {"PUBLIC_KEY": PUBLIC_KEY}
    assert data["plan"]["request"]["dataCenterIds"] == ["US-KS-2"] and data["plan"]["request"]["startSsh"] is True
    assert runpod.sent("POST") == []


def test_create_yes_sends_the_planned_body_once(h3, runpod, key_file):
    run = h3("pod", "create", "--count", "8", "--datacenter", "US-KS-2", "--ssh-public-key", str(key_file), "--yes")
    assert run.code == 0, run.err
    (post,) = runpod.sent("POST", "/v2/pods")
    assert post.body == {
        "name": "h3-8gpu", "image": "runpod/pytorch:1.0.3-cu1300-torch291-ubuntu2404",
        "gpu": {"id": SERVER_EDITION, "count": 8, "minCudaVersion": "13.0"}, "cloud": "SECURE",
        "dataCenterIds": ["US-KS-2"], "disk": 50, "ports": ["22/tcp"], "env": {"PUBLIC_KEY": PUBLIC_KEY},
        "mounts": {"persistent": {"size": 100, "path": "/workspace"}}, "startSsh": True,
    }
    assert "created pod pod0000001" in run.out and "next: h3 pod get pod0000001" in run.out
    assert f"PUBLIC_KEY from {key_file}" in run.out


def test_create_as_written_in_the_issue_picks_the_data_center(h3, runpod):
    run = h3("pod", "create", "--count", "8", "--yes", "--json")
    assert run.code == 0, run.err
    data = json.loads(run.out)
    assert data["created"] is True and data["pod"]["data_center_id"] == "EUR-IS-1"
    assert data["pod"]["status"] == "PROVISIONING" and data["pod"]["cost"] == pytest.approx(15.12)
    assert runpod.sent("POST")[0].body["dataCenterIds"] == ["EUR-IS-1"]


def test_create_with_a_network_volume(h3, runpod, key_file):
    run = h3("pod", "create", "--count", "1", "--network-volume", "vol1234567", "--volume-mount-path", "/runpod-volume",
             "--ssh-public-key", str(key_file), "--yes")
    assert run.code == 0, run.err
    body = runpod.sent("POST")[0].body
    assert body["mounts"] == {"network": [{"volumeId": "vol1234567", "path": "/runpod-volume"}]}
    assert body["dataCenterIds"] == ["US-KS-2"] and body["gpu"]["count"] == 1


def test_create_with_no_stock_stops_before_posting(h3, runpod):
    run = h3("pod", "create", "--gpu-type", WORKSTATION_EDITION, "--yes")
    assert run.code == 1
    assert run.error_line().startswith(f"error: no stock for 8 x {WORKSTATION_EDITION} on SECURE")
    assert runpod.sent("POST") == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ssh-public-key", "/nonexistent/id.pub"], "cannot read --ssh-public-key /nonexistent/id.pub: a part of the path does not exist"),
        (["--network-volume", "vol1234567", "--volume-gb", "50"], "--network-volume exclude each other"),
        (["--volume-gb", "5"], "--volume-gb 5: must be at least 10"),
        (["--min-cuda", "13"], "--min-cuda '13' is not a CUDA version like 13.0"),
        (["--volume-mount-path", "data"], "--volume-mount-path 'data'"),
    ],
)
def test_bad_create_flags_are_one_line_and_send_nothing(h3, runpod, args, message):
    run = h3("pod", "create", *args, "--yes")
    assert run.code == 2 and message in run.error_line()
    assert runpod.requests == []


def test_create_refused_by_the_server_is_one_line(h3, runpod):
    runpod.script("POST", "/v2/pods", 402, problem(402, "Payment Required", "insufficient balance"))
    run = h3("pod", "create", "--yes")
    assert run.code == 1
    assert run.error_line() == (
        "error: RunPod create pod failed: HTTP 402 Payment Required: insufficient balance; "
        "insufficient balance: add funds to the RunPod account; nothing was created"
    )


def test_create_server_error_is_not_retried(h3, runpod):
    runpod.script("POST", "/v2/pods", 503, times=3)
    run = h3("pod", "create", "--yes")
    assert run.code == 1 and "the pod may exist and cost money: check `h3 pod list`" in run.error_line()
    assert len(runpod.sent("POST")) == 1


def test_create_timeout_is_one_line_and_not_retried(h3, runpod, monkeypatch):
    monkeypatch.setattr(client_module, "WRITE_TIMEOUT_S", 0.2)
    runpod.script("POST", "/v2/pods", stall=True, times=3)
    run = h3("pod", "create", "--yes")
    assert run.code == 1 and "no complete answer within 0.2 s; it may or may not have been applied" in run.error_line()
    assert len(runpod.sent("POST")) == 1


# --- get / list -------------------------------------------------------------------------------------------


def test_get_prints_status_gpus_cost_and_the_ssh_and_rsync_lines(h3, runpod):
    pod = runpod.add_pod()
    run = h3("pod", "get", pod["id"])
    assert run.code == 0, run.err
    assert run.out.splitlines()[0] == f"pod {pod['id']}  h3-8gpu  RUNNING"
    assert f"8 x {SERVER_EDITION} (util 0%, 0%, 0%, 0%, 0%, 0%, 0%, 0%)" in run.out
    assert "US-KS-2 · SECURE · host CUDA 13.0" in run.out and "$15.12/h" in run.out
    assert "ssh       ssh -p 40022 root@203.0.113.7" in run.out
    assert "rsync --protect-args -e 'ssh -p 40022' -azP '--filter=:- .gitignore' ./ root@203.0.113.7:/workspace/h3/" in run.out
    assert ("rsync --protect-args -e 'ssh -p 40022' -P \"$H3_MODEL_PATH\" \"$H3_TEXT_ENCODER_PATH\" \"$H3_VIDEO_VAE_PATH\" \"$H3_AUDIO_VAE_PATH\" "
            "root@203.0.113.7:/workspace/checkpoints/") in run.out
    assert "cd /workspace/h3 && export H3_MODEL_PATH=/workspace/checkpoints/minimax_h3_fl2va_pruned_nvfp4.safetensors" in run.out


def test_get_json_and_a_pod_that_is_still_starting(h3, runpod):
    run = h3("pod", "create", "--yes", "--json")
    pod_id = json.loads(run.out)["pod"]["id"]
    data = json.loads(h3("pod", "get", pod_id, "--json").out)
    assert data["pod"]["status"] == "PROVISIONING" and data["access"]["ssh"] is None
    assert "run `h3 pod get" in data["access"]["note"]
    runpod.set_running(pod_id)
    data = json.loads(h3("pod", "get", pod_id, "--json").out)
    assert data["access"]["ssh"] == "ssh -p 40022 root@203.0.113.7" and data["pod"]["gpu"]["count"] == 8


def test_get_unknown_or_malformed_pod_id_is_one_line(h3, runpod):
    run = h3("pod", "get", "nosuchpod1")
    assert run.code == 1
    assert run.error_line() == (
        "error: RunPod pod nosuchpod1 failed: HTTP 404 Not Found: pod not found; "
        "unknown pod id 'nosuchpod1'; `h3 pod list` shows your pods"
    )
    run = h3("pod", "get", "../../v2/account")
    assert run.code == 2 and "is not a RunPod pod id" in run.error_line()


def test_list_table_json_and_empty(h3, runpod):
    assert h3("pod", "list").out.strip() == "no pods"
    first, second = runpod.add_pod(), runpod.add_pod(name="other")
    run = h3("pod", "list")
    assert run.code == 0 and first["id"] in run.out and second["id"] in run.out and "15.12" in run.out
    data = json.loads(h3("pod", "list", "--json").out)
    assert [p["name"] for p in data["pods"]] == ["h3-8gpu", "other"]


# --- terminate ---------------------------------------------------------------------------------------------


def test_terminate_without_yes_previews_and_sends_no_delete(h3, runpod):
    pod = runpod.add_pod()
    run = h3("pod", "terminate", pod["id"])
    assert run.code == 2
    assert f"would terminate pod {pod['id']}  h3-8gpu  RUNNING" in run.out
    assert "its container disk and its persistent storage (100 GB at /workspace)" in run.out
    assert run.error_line() == f"error: nothing terminated: add --yes to terminate pod {pod['id']}"
    assert runpod.sent("DELETE") == [] and pod["id"] in runpod.pods


def test_terminate_yes_deletes_once(h3, runpod):
    pod = runpod.add_pod()
    run = h3("pod", "terminate", pod["id"], "--yes", "--json")
    assert run.code == 0 and json.loads(run.out) == {"pod_id": pod["id"], "terminated": True, "pod": None, "loses": None}
    assert len(runpod.sent("DELETE")) == 1 and runpod.pods == {}
    again = h3("pod", "terminate", pod["id"], "--yes")
    assert again.code == 1 and f"unknown pod id '{pod['id']}'" in again.error_line()


# --- auth, environment, rate limits, server errors, timeouts -----------------------------------------------


@pytest.mark.parametrize("command", [["catalog"], ["create", "--yes"], ["get", "pod0000001"], ["list"], ["terminate", "pod0000001", "--yes"]])
def test_missing_api_key_is_one_line_exit_2_and_sends_nothing(h3, runpod, monkeypatch, command):
    monkeypatch.delenv("RUNPOD_API_KEY")
    run = h3("pod", *command)
    assert run.code == 2 and run.error_line().startswith("error: RUNPOD_API_KEY is not set; create an API key in the RunPod console")
    assert runpod.requests == []


def test_a_rejected_key_is_one_line(h3, runpod, monkeypatch):
    monkeypatch.setenv("RUNPOD_API_KEY", "rpa_revoked_key_0000")
    run = h3("pod", "list")
    assert run.code == 1 and "HTTP 401 Unauthorized: invalid bearer token" in run.error_line()
    assert "rpa_revoked_key_0000" not in run.out + run.err


def test_rate_limited_reads_are_retried_after_retry_after(h3, runpod):
    runpod.script("GET", "/v2/pods", 429, problem(429, "Too Many Requests", "minute window"), headers={"Retry-After": "0"}, times=2)
    run = h3("pod", "list")
    assert run.code == 0 and run.out.strip() == "no pods" and len(runpod.sent("GET")) == 3


def test_server_errors_on_reads_give_up_with_one_line(h3, runpod):
    runpod.script("GET", "/v2/pods", 500, problem(500, "Internal Server Error", "database unavailable"), times=9)
    run = h3("pod", "list")
    assert run.code == 1
    assert "RunPod pod list failed after 3 tries: HTTP 500 Internal Server Error: database unavailable" in run.error_line()
    assert len(runpod.sent("GET")) == 3


def test_a_stalled_read_times_out_with_one_line(h3, runpod, monkeypatch):
    monkeypatch.setattr(client_module, "READ_TIMEOUT_S", 0.2)
    runpod.script("GET", "/v2/pods", stall=True, times=9)
    run = h3("pod", "list")
    assert run.code == 1 and "failed after 3 tries: no complete answer within 0.2 s" in run.error_line()


# --- a real process ---------------------------------------------------------------------------------------


def _h3_process(runpod, *args: str, key: str = TEST_KEY) -> subprocess.CompletedProcess:
    env = {"RUNPOD_API_KEY": key, "RUNPOD_API_BASE_URL": runpod.base_url, "COLUMNS": "200", "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
    proc = h3_process("pod", *args, env=env, timeout=60)
    assert TEST_KEY not in proc.stdout and TEST_KEY not in proc.stderr
    return proc


def test_create_get_terminate_in_real_processes(runpod, key_file):
    refused = _h3_process(runpod, "create", "--count", "8", "--ssh-public-key", str(key_file))
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "error: nothing created: add --yes to create this pod (about $15.12/h while it exists)"
    ]
    assert runpod.sent("POST") == []
    created = _h3_process(runpod, "create", "--count", "8", "--ssh-public-key", str(key_file), "--yes", "--json")
    assert created.returncode == 0 and created.stderr == ""
    pod_id = json.loads(created.stdout)["pod"]["id"]
    runpod.set_running(pod_id)
    got = _h3_process(runpod, "get", pod_id)
    assert got.returncode == 0 and "ssh -p 40022 root@203.0.113.7" in got.stdout
    gone = _h3_process(runpod, "terminate", pod_id, "--yes")
    assert gone.returncode == 0 and f"terminated pod {pod_id}" in gone.stdout and runpod.pods == {}
    unknown = _h3_process(runpod, "get", pod_id)
    assert unknown.returncode == 1 and len(unknown.stderr.strip().splitlines()) == 1 and "unknown pod id" in unknown.stderr
    assert all(r.authorized for r in runpod.requests)


def test_help_lists_the_pod_commands():
    result = CliRunner().invoke(app, ["pod", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for command in ("catalog", "create", "get", "list", "terminate"):
        assert command in result.stdout


# --- copy-paste lines: every word from the server is quoted ---------------------------------------------------

HOSTILE_MOUNTS = ["/work space", "/w/$(touch {pwned})", "/w/`touch {pwned}`", "/w;touch {pwned}", "/w/'q'\"d\"", "/w/*", "/w/$HOME"]


def _stub(bin_dir, name):
    """A stand-in for `name` that records the words it got, one per line (NUL-free test words)."""
    path = bin_dir / name
    path.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "$(dirname "$0")/{name}.args"\n')
    path.chmod(0o755)


@pytest.mark.parametrize("mount", HOSTILE_MOUNTS)
def test_the_ssh_and_rsync_lines_pass_a_server_path_as_one_word_and_run_nothing(h3, runpod, tmp_path, mount):
    pwned = tmp_path / "PWNED"
    root = str(tmp_path) + mount.format(pwned=pwned)
    pod = runpod.add_pod(mounts={"persistent": {"size": 100, "path": root}})
    data = json.loads(h3("pod", "get", pod["id"], "--json").out)["access"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("rsync", "ssh"):
        _stub(bin_dir, name)
    local = {"H3_MODEL_PATH": "/local/m.safetensors", "H3_TEXT_ENCODER_PATH": "/local/t.safetensors",
             "H3_VIDEO_VAE_PATH": "/local/v.safetensors", "H3_AUDIO_VAE_PATH": "/local/a.safetensors"}
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", **local}
    for key in ("rsync_checkout", "rsync_checkpoints"):
        subprocess.run(["bash", "-c", data[key]], check=True, env=env, cwd=tmp_path)
        words = (bin_dir / "rsync.args").read_text().splitlines()
        remote = "h3/" if key == "rsync_checkout" else "checkpoints/"
        assert words[-1] == f"root@203.0.113.7:{root}/{remote}", (key, data[key], words)
        assert "--protect-args" in words and words[words.index("-e") + 1] == "ssh -p 40022"
    assert (bin_dir / "rsync.args").read_text().splitlines()[-5:-1] == list(local.values())
    (tmp_path / "remote").mkdir()
    checkout = tmp_path / "remote" / "checkout"
    checkout.mkdir()
    on_pod = data["on_pod"].replace(shlex.quote(f"{root}/h3"), shlex.quote(str(checkout)), 1)  # cd somewhere that exists here
    shown = subprocess.run(["bash", "-c", on_pod + ' && printf "%s\\n" "$PWD" "$H3_MODEL_PATH"'], check=True, env=env,
                           capture_output=True, text=True, cwd=tmp_path).stdout.splitlines()
    assert shown == [str(checkout), f"{root}/checkpoints/minimax_h3_fl2va_pruned_nvfp4.safetensors"]
    assert not pwned.exists()  # nothing in the server's text ran
