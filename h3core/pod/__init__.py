"""`h3 pod`'s engine: a guarded RunPod REST API v2 client and the create/catalog/access logic.

No CLI code here. Entry points: `RunPodClient.from_env()`, `fetch_catalog`, `plan_create` +
`create_pod`, `pod_access`, `terminate`. Reads retry; writes are sent once and only when the
caller confirmed.
"""

from h3core.pod.access import (
    CHECKPOINT_BYTES,
    MODEL_CHECKPOINT,
    TEXT_ENCODER_CHECKPOINT,
    PodAccess,
    PodList,
    PodReport,
    pod_access,
    pod_list,
    pod_report,
)
from h3core.pod.catalog import (
    DEFAULT_COUNT,
    DEFAULT_GPU_TYPE,
    DEFAULT_MIN_CUDA,
    Catalog,
    DataCenterChoice,
    DataCenterStock,
    choose_datacenter,
    fetch_catalog,
    parse_min_cuda,
)
from h3core.pod.client import DEFAULT_RETRY, RetryPolicy, RunPodClient
from h3core.pod.create import (
    DEFAULT_IMAGE,
    CreateOptions,
    CreatePlan,
    CreateResult,
    create_pod,
    plan_create,
    read_public_key,
)
from h3core.pod.models import Availability, Cloud, CreatePodRequest, Pod
from h3core.pod.terminate import TerminateResult, preview_terminate, terminate

__all__ = [
    "CHECKPOINT_BYTES", "MODEL_CHECKPOINT", "TEXT_ENCODER_CHECKPOINT",
    "PodAccess", "PodList", "PodReport", "pod_access", "pod_list", "pod_report",
    "DEFAULT_COUNT", "DEFAULT_GPU_TYPE", "DEFAULT_MIN_CUDA", "Catalog", "DataCenterChoice", "DataCenterStock",
    "choose_datacenter", "fetch_catalog", "parse_min_cuda", "DEFAULT_RETRY", "RetryPolicy", "RunPodClient", "DEFAULT_IMAGE",
    "CreateOptions", "CreatePlan", "CreateResult", "create_pod", "plan_create", "read_public_key",
    "Availability", "Cloud", "CreatePodRequest", "Pod", "TerminateResult", "preview_terminate", "terminate",
]
