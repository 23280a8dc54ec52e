"""Typed shapes of RunPod's REST API v2, as far as `h3 pod` uses them.

Two kinds of model, on purpose:

- `_Answer` models read what the API returns. They ignore fields h3 does not use (the API adds
  fields over time) and keep only the ones shown or reasoned about. `Pod.env` is deliberately
  absent: a pod's environment can hold secrets, and nothing h3 prints needs it.
- `_Body` models are what h3 sends. They forbid unknown fields and mirror `CreatePodRequest` of
  the OpenAPI file exactly (the real API rejects any field it does not know), serialised with
  the API's camelCase names and without unset fields via `body()`.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


class Cloud(str, Enum):
    """RunPod's cloud tier: `SECURE` (RunPod's data centers) or `COMMUNITY` (hosted by others)."""

    SECURE = "SECURE"
    COMMUNITY = "COMMUNITY"


class Availability(str, Enum):
    """Catalog stock level, lowest to highest."""

    NONE = "NONE"
    LOW = "LOW"
    MEDIUM = "MEDIUM"
    HIGH = "HIGH"

    @property
    def rank(self) -> int:
        """0 for NONE up to 3 for HIGH: more stock, higher rank."""
        return list(Availability).index(self)


class _Answer(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True)


class _Body(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)

    def body(self) -> dict[str, Any]:
        """The JSON object sent on the wire: camelCase names, unset (None) fields left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


# --- catalog ---------------------------------------------------------------------------------


class PerCloud(_Answer):
    """A figure quoted separately for the secure and the community cloud."""

    secure: float
    community: float

    def for_cloud(self, cloud: Cloud) -> float:
        return self.secure if cloud is Cloud.SECURE else self.community


class DataCenterAvailability(_Answer):
    id: str = Field(description="Data center id, e.g. US-KS-2.")
    name: str = Field(description="Human-readable name, e.g. 'US Kansas 2'.")
    availability: Availability


class CudaVersionAvailability(_Answer):
    version: str = Field(description="CUDA version as major.minor.")
    available: bool = Field(description="True when a machine on this version has free capacity now.")


class GpuType(_Answer):
    """`GET /v2/catalog/gpus/{id}`: one GPU type, its list price and (when asked) its stock."""

    id: str = Field(description="GPU type id, used verbatim in a pod create.")
    name: str
    memory: int = Field(description="VRAM in GB.")
    price: PerCloud = Field(description="List price in USD per hour for ONE GPU, per cloud.")
    max_count: PerCloud = Field(description="Largest GPU count of one machine per cloud (a ceiling, not stock).")
    availability: Optional[Availability] = Field(None, description="Overall stock for the asked count and cloud.")
    data_centers: list[DataCenterAvailability] = Field(
        default_factory=list, description="Stock per data center; absent when unavailable everywhere."
    )
    cuda_versions: list[CudaVersionAvailability] = Field(default_factory=list)


class NetworkVolume(_Answer):
    """`GET /v2/network-volumes/{id}`: a volume lives in one data center, for good."""

    id: str
    name: str
    size: int = Field(description="GB allocated.")
    data_center: str = Field(description="Data center id; a pod that mounts the volume must run there.")


# --- pods --------------------------------------------------------------------------------------


class PersistentMount(_Body):
    """Host-local storage that lives as long as the pod (destroyed by terminate)."""

    size: int = Field(ge=10, description="GB; RunPod's floor is 10.")
    path: str = Field(description="Mount path inside the container.")


class NetworkMount(_Body):
    """An existing network volume (same data center as the pod); terminate only detaches it."""

    volume_id: str
    path: str


class Mounts(_Body):
    """At most one of `persistent` or `network` (RunPod refuses both)."""

    persistent: Optional[PersistentMount] = None
    network: Optional[list[NetworkMount]] = Field(None, max_length=1)

    def path(self) -> Optional[str]:
        """Where the pod's storage is mounted, whichever kind it is."""
        if self.persistent is not None:
            return self.persistent.path
        return self.network[0].path if self.network else None

    def describe(self) -> str:
        if self.persistent is not None:
            return f"persistent {self.persistent.size} GB at {self.persistent.path} (destroyed on terminate)"
        if self.network:
            return f"network volume {self.network[0].volume_id} at {self.network[0].path}"
        return "none (container disk only)"


class CreateGpu(_Body):
    """`CreateGpuConfig`: which GPU type, how many, and the host CUDA floor."""

    id: str = Field(description="GPU type id from the catalog.")
    count: int = Field(ge=1, description="GPUs on the pod (one machine).")
    min_cuda_version: Optional[str] = Field(
        None, pattern=r"^\d+\.\d+$", description="Lowest host CUDA version (major.minor) the image needs."
    )


class CreatePodRequest(_Body):
    """`POST /v2/pods` body (the `CreatePodRequest` schema; only the fields h3 sets)."""

    name: str = Field(min_length=1)
    image: str = Field(min_length=1)
    gpu: CreateGpu
    cloud: Cloud
    data_center_ids: list[str] = Field(min_length=1, description="Data center h3 chose or was told to use.")
    disk: int = Field(ge=1, description="Container disk in GB (wiped on restart).")
    ports: list[str]
    env: dict[str, str] = Field(default_factory=dict)
    mounts: Mounts
    start_ssh: bool


class PodGpu(_Answer):
    id: str
    count: int = 1


class SshEndpoint(_Answer):
    host: str
    port: int
    username: str
    command: str


class PodSsh(_Answer):
    proxy: Optional[SshEndpoint] = Field(None, description="RunPod's SSH proxy: interactive shell only.")
    direct: Optional[SshEndpoint] = Field(None, description="The pod's own sshd on 22/tcp: scp/rsync work.")


class GpuUtilization(_Answer):
    util: Optional[int] = None
    memory_util: Optional[int] = None


class RuntimePort(_Answer):
    private: Optional[int] = None
    public: Optional[int] = None
    type: Optional[str] = None
    ip: Optional[str] = None


class PodRuntime(_Answer):
    uptime: Optional[int] = Field(None, description="Seconds since the container started.")
    gpus: list[GpuUtilization] = Field(default_factory=list)
    ports: list[RuntimePort] = Field(default_factory=list)


class Pod(_Answer):
    """`GET /v2/pods/{id}` (and the `POST /v2/pods` answer). No `env`: see the module docstring."""

    id: str
    name: str
    status: str = Field(description="PROVISIONING, STARTING, RUNNING, EXITED, ERROR or TERMINATED.")
    image: Optional[str] = None
    gpu: Optional[PodGpu] = None
    cloud: Optional[Cloud] = None
    data_center_id: Optional[str] = None
    cuda_version: Optional[str] = None
    cost: Optional[float] = Field(None, description="USD per hour billed now (0 when stopped).")
    disk: Optional[int] = None
    mounts: Optional[Mounts] = None
    ports: list[str] = Field(default_factory=list)
    ssh: Optional[PodSsh] = None
    runtime: Optional[PodRuntime] = None
    created_at: Optional[str] = None
    started_at: Optional[str] = None

    def gpu_text(self) -> str:
        return f"{self.gpu.count} x {self.gpu.id}" if self.gpu else "no GPU"
