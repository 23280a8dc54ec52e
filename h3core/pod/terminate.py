"""Terminate a pod: a preview (one read) without confirmation, one DELETE with it."""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, Field

from h3core.pod.client import RunPodClient, check_pod_id
from h3core.pod.models import Pod


class TerminateResult(BaseModel):
    """What `h3 pod terminate` did (or, unconfirmed, would do)."""

    pod_id: str
    terminated: bool = Field(description="False: previewed only, nothing was sent.")
    pod: Optional[Pod] = Field(None, description="The pod as it is now (preview only).")
    loses: Optional[str] = Field(None, description="What terminating destroys, when known.")


def preview_terminate(client: RunPodClient, pod_id: str) -> TerminateResult:
    """Read the pod (an unknown id fails here) and say what terminating it would destroy."""
    pod = client.get_pod(check_pod_id(pod_id))
    loses = "its container disk"
    if pod.mounts and pod.mounts.persistent is not None:
        loses += f" and its persistent storage ({pod.mounts.persistent.size} GB at {pod.mounts.persistent.path})"
    elif pod.mounts and pod.mounts.network:
        loses += f"; network volume {pod.mounts.network[0].volume_id} is only detached and keeps its data"
    return TerminateResult(pod_id=pod.id, terminated=False, pod=pod, loses=loses)


def terminate(client: RunPodClient, pod_id: str) -> TerminateResult:
    """DELETE the pod, once."""
    client.terminate_pod(check_pod_id(pod_id))
    return TerminateResult(pod_id=pod_id, terminated=True)
