"""How to reach a pod and what to copy onto it: the ssh line, the rsync lines, the remote paths.

These are the runbook's transfer steps (docs/runpod.md) made concrete for one pod. rsync needs the
pod's direct SSH endpoint (its own sshd on 22/tcp); RunPod's proxy carries an interactive shell only.

Every line is meant to be pasted into a shell, and most of its words come from RunPod's answer
(host, user, the storage's mount path, the pod id): each line is built from its words by
`shell_line`, which quotes every one (`shlex.quote`), so that a mount path `$(touch x)` stays a
path and one with a space stays one word. rsync gets `--protect-args`, so that the remote shell
does not split or expand the remote path either (older rsync versions let it).
"""

from __future__ import annotations

import shlex
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

from h3core.pod.client import RunPodClient
from h3core.pod.create import DEFAULT_MOUNT_PATH
from h3core.pod.models import Pod, SshEndpoint

# The two checkpoints the seed runs (name -> exact size in bytes).
MODEL_CHECKPOINT = "minimax_h3_fl2va_pruned_nvfp4.safetensors"
TEXT_ENCODER_CHECKPOINT = "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors"
CHECKPOINT_BYTES = {MODEL_CHECKPOINT: 12_528_636_800, TEXT_ENCODER_CHECKPOINT: 15_687_142_551}
# The two VAEs that decode the latents into video.mp4 (docs/decode.md).
VIDEO_VAE_CHECKPOINT = "minimax_h3_video_vae_fp16.safetensors"
AUDIO_VAE_CHECKPOINT = "minimax_h3_audio_vae_fp32.safetensors"


class PodAccess(BaseModel):
    """Ready-to-run lines for one pod; empty commands while it has no direct SSH endpoint yet."""

    model_config = ConfigDict(frozen=True)

    ssh: Optional[str] = Field(description="ssh into the pod (direct endpoint, supports rsync).")
    proxy_ssh: Optional[str] = Field(description="ssh through RunPod's proxy (interactive shell only).")
    rsync_checkout: Optional[str] = Field(description="Copy this checkout (run from its root) to the pod.")
    rsync_checkpoints: Optional[str] = Field(
        description="Copy the checkpoints, named by the local H3_MODEL_PATH, H3_TEXT_ENCODER_PATH, H3_VIDEO_VAE_PATH and H3_AUDIO_VAE_PATH."
    )
    remote_checkout: str = Field(description="Where the checkout lands on the pod.")
    remote_env: dict[str, str] = Field(description="Variables to export on the pod so h3 finds the checkpoints.")
    on_pod: str = Field(description="The line to run on the pod: cd into the checkout and export `remote_env`.")
    note: Optional[str] = Field(None, description="Why a line is missing, when one is.")


def shell_line(*words: str) -> str:
    """A command line that a shell reads back as exactly `words` (each one quoted as needed)."""
    return shlex.join(words)


def _ssh_command(endpoint: SshEndpoint) -> str:
    return shell_line("ssh", "-p", str(endpoint.port), f"{endpoint.username}@{endpoint.host}")


def _on_pod(checkout: str, remote_env: dict[str, str]) -> str:
    exports = " ".join(shlex.quote(f"{name}={value}") for name, value in remote_env.items())
    return f"{shell_line('cd', checkout)} && export {exports}"


def get_pod_line(pod_id: str) -> str:
    """`h3 pod get ID`, for a pod id as the server gave it."""
    return shell_line("h3", "pod", "get", pod_id)


def pod_access(pod: Pod) -> PodAccess:
    """The ssh/rsync lines for `pod`, with remote paths under its storage mount (default /workspace)."""
    root = (pod.mounts.path() if pod.mounts else None) or DEFAULT_MOUNT_PATH
    checkout = f"{root}/h3"
    checkpoints = f"{root}/checkpoints"
    remote_env = {
        "H3_MODEL_PATH": f"{checkpoints}/{MODEL_CHECKPOINT}",
        "H3_TEXT_ENCODER_PATH": f"{checkpoints}/{TEXT_ENCODER_CHECKPOINT}",
        "H3_VIDEO_VAE_PATH": f"{checkpoints}/{VIDEO_VAE_CHECKPOINT}",
        "H3_AUDIO_VAE_PATH": f"{checkpoints}/{AUDIO_VAE_CHECKPOINT}",
    }
    ssh = pod.ssh
    direct = ssh.direct if ssh else None
    proxy = _ssh_command(ssh.proxy) if ssh and ssh.proxy else None
    on_pod = _on_pod(checkout, remote_env)
    if direct is None:
        note = (
            f"no direct SSH endpoint yet (status {pod.status}); run `{get_pod_line(pod.id)}` again once it is RUNNING"
            if _exposes_ssh(pod) else "the pod does not expose 22/tcp, so rsync/scp cannot reach it (proxy shell only)"
        )
        return PodAccess(ssh=None, proxy_ssh=proxy, rsync_checkout=None, rsync_checkpoints=None,
                         remote_checkout=checkout, remote_env=remote_env, on_pod=on_pod, note=note)
    target = f"{direct.username}@{direct.host}"
    rsync = ("rsync", "--protect-args", "-e", f"ssh -p {direct.port}")
    return PodAccess(
        ssh=_ssh_command(direct),
        proxy_ssh=proxy,
        rsync_checkout=shell_line(*rsync, "-azP", "--filter=:- .gitignore", "./", f"{target}:{checkout}/"),
        # the four local files are the user's own variables, left for their shell to expand
        rsync_checkpoints=(f'{shell_line(*rsync, "-P")} "$H3_MODEL_PATH" "$H3_TEXT_ENCODER_PATH" "$H3_VIDEO_VAE_PATH" "$H3_AUDIO_VAE_PATH" '
                           f'{shell_line(f"{target}:{checkpoints}/")}'),
        remote_checkout=checkout,
        remote_env=remote_env,
        on_pod=on_pod,
    )


def _exposes_ssh(pod: Pod) -> bool:
    return any(port.replace(" ", "") == "22/tcp" for port in pod.ports)


class PodReport(BaseModel):
    """`h3 pod get`: the pod as RunPod reports it, and how to reach it."""

    pod: Pod
    access: PodAccess


class PodList(BaseModel):
    """`h3 pod list`: every pod of the account (cluster members excluded, as RunPod does by default)."""

    pods: list[Pod]


def pod_report(client: RunPodClient, pod_id: str) -> PodReport:
    pod = client.get_pod(pod_id)
    return PodReport(pod=pod, access=pod_access(pod))


def pod_list(client: RunPodClient) -> PodList:
    return PodList(pods=client.list_pods())
