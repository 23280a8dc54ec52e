"""Plan a pod create (reads only), then create it (one POST, only when the caller confirmed).

The plan is exactly the body that would be sent plus what it costs and where it goes; a command
shows it and stops unless `--yes` was given. Defaults follow the seed: the RTX PRO 6000 Blackwell
Server Edition, RunPod's CUDA 13.0 + torch 2.9.1 image, persistent workspace storage and SSH.
"""

from __future__ import annotations

import pathlib
from typing import Any, ClassVar, Optional

from pydantic import BaseModel, ConfigDict, Field, field_serializer, model_validator

from h3core.errors import ConfigError, RemoteAPIError
from h3core.files.text import read_text
from h3core.pod.catalog import (
    DEFAULT_COUNT,
    DEFAULT_GPU_TYPE,
    DEFAULT_MIN_CUDA,
    Catalog,
    DataCenterChoice,
    choose_datacenter,
    fetch_catalog,
)
from h3core.pod.client import RunPodClient
from h3core.pod.models import (
    Availability,
    Cloud,
    CreateGpu,
    CreatePodRequest,
    Mounts,
    NetworkMount,
    PersistentMount,
    Pod,
)
from h3core.settings import UserRequest

DEFAULT_IMAGE = "runpod/pytorch:1.0.3-cu1300-torch291-ubuntu2404"
DEFAULT_DISK_GB = 50
# Holds the checkout, both checkpoints (28.2 GB) and the reports with room to spare.
DEFAULT_VOLUME_GB = 100
DEFAULT_MOUNT_PATH = "/workspace"
SSH_PORT = "22/tcp"
_KEY_TYPES = ("ssh-", "ecdsa-sha2-", "sk-ssh-", "sk-ecdsa-")
_MAX_KEY_BYTES = 16 * 1024
_FLAGS = {"disk_gb": "--disk", "volume_gb": "--volume-gb", "mount_path": "--volume-mount-path", "min_cuda": "--min-cuda"}


class CreateOptions(UserRequest):
    """What `h3 pod create` was asked for; `None` means "h3 decides" (see each field). A bad value
    is one ConfigError line naming its flag (`UserRequest`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    FLAGS: ClassVar[dict[str, str]] = _FLAGS

    count: int = Field(DEFAULT_COUNT, ge=1, description="GPUs on the pod (one machine).")
    gpu_type: str = Field(DEFAULT_GPU_TYPE, min_length=1, description="GPU type id from RunPod's catalog.")
    cloud: Cloud = Field(Cloud.SECURE, description="SECURE or COMMUNITY.")
    datacenter: Optional[str] = Field(None, description="Data center id; None: the one with the most stock.")
    image: str = Field(DEFAULT_IMAGE, min_length=1, description="Container image.")
    name: Optional[str] = Field(None, description="Pod name; None: h3-<count>gpu.")
    disk_gb: int = Field(DEFAULT_DISK_GB, ge=1, description="Container disk in GB (wiped on restart).")
    volume_gb: Optional[int] = Field(
        None, ge=10, description=f"Persistent workspace storage in GB; None: {DEFAULT_VOLUME_GB} unless a network volume is used."
    )
    network_volume: Optional[str] = Field(
        None, pattern=r"^[A-Za-z0-9_-]{1,64}$", description="Existing network volume id to mount instead."
    )
    mount_path: str = Field(DEFAULT_MOUNT_PATH, pattern=r"^/", description="Where the storage is mounted in the pod.")
    ssh_public_key: Optional[pathlib.Path] = Field(
        None, description="Public key file put in the pod's PUBLIC_KEY; None: the account's registered keys."
    )
    min_cuda: Optional[str] = Field(
        DEFAULT_MIN_CUDA, pattern=r"^\d+\.\d+$", description="Lowest host CUDA version; None: any host."
    )

    @model_validator(mode="after")
    def _one_kind_of_storage(self) -> "CreateOptions":
        if self.network_volume and self.volume_gb is not None:
            raise ConfigError(
                "--volume-gb (persistent storage) and --network-volume exclude each other on RunPod; drop one"
            )
        return self

    @classmethod
    def build(cls, **values: Any) -> "CreateOptions":
        """Validate flags; a bad value becomes a one-line `ConfigError` naming the flag."""
        return cls(**values)

    def pod_name(self) -> str:
        return self.name or f"h3-{self.count}gpu"

    def mounts(self) -> Mounts:
        if self.network_volume:
            return Mounts(network=[NetworkMount(volume_id=self.network_volume, path=self.mount_path)])
        return Mounts(persistent=PersistentMount(size=self.volume_gb or DEFAULT_VOLUME_GB, path=self.mount_path))


def read_public_key(path: pathlib.Path) -> str:
    """The OpenSSH public key(s) in `path`, checked; a private key or unreadable file is a `ConfigError`."""
    hint = "pass a readable .pub file, e.g. ~/.ssh/id_ed25519.pub"
    text = read_text(path, "--ssh-public-key", _MAX_KEY_BYTES, hint)
    if "PRIVATE KEY" in text:
        raise ConfigError(f"--ssh-public-key {path} is a PRIVATE key; pass the matching public key ({path}.pub)")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not lines or not all(line.startswith(_KEY_TYPES) and len(line.split()) >= 2 for line in lines):
        raise ConfigError(
            f"--ssh-public-key {path} is not an OpenSSH public key (expected a line like 'ssh-ed25519 AAAA... you@host')"
        )
    return "\n".join(lines)


class CreatePlan(BaseModel):
    """Exactly what a create would send, where it goes, what it costs per hour, and what to watch out for."""

    model_config = ConfigDict(frozen=True)

    request: CreatePodRequest = Field(description="The POST /v2/pods body, verbatim (camelCase in JSON).")
    datacenter: DataCenterChoice
    catalog: Catalog = Field(description="The catalog read the plan is based on (price, stock).")
    warnings: list[str] = Field(default_factory=list)

    @field_serializer("request")
    def _wire_body(self, request: CreatePodRequest) -> dict[str, Any]:
        return request.body()

    @property
    def price_per_hour(self) -> float:
        return self.catalog.price_per_hour


class CreateResult(BaseModel):
    """`h3 pod create`'s output: the plan, and the pod when it was created."""

    plan: CreatePlan
    created: bool = Field(description="False: shown only (no --yes), nothing was sent.")
    pod: Optional[Pod] = None


def _check_count(options: CreateOptions, catalog: Catalog) -> None:
    if catalog.max_count == 0:
        raise ConfigError(
            f"{options.gpu_type} is not offered on the {options.cloud.value} cloud; try --cloud {_other(options.cloud)}"
        )
    if options.count > catalog.max_count:
        raise ConfigError(
            f"--count {options.count} exceeds the largest {options.cloud.value} machine of {options.gpu_type} "
            f"({catalog.max_count} GPUs); a pod is one machine"
        )


def _other(cloud: Cloud) -> str:
    return (Cloud.COMMUNITY if cloud is Cloud.SECURE else Cloud.SECURE).value


def _ssh_warnings(client: RunPodClient, options: CreateOptions) -> list[str]:
    """Warn when the pod would have no way in over SSH (no key file and no account keys)."""
    if options.ssh_public_key is not None:
        return []
    try:
        keys = client.ssh_keys()
    except RemoteAPIError as err:
        return [f"could not read the account's SSH keys ({err}); pass --ssh-public-key to be sure of SSH access"]
    if keys:
        return []
    return ["no --ssh-public-key and no SSH key registered on the RunPod account: the pod will have no SSH access; "
            "pass --ssh-public-key ~/.ssh/id_ed25519.pub"]


def plan_create(client: RunPodClient, options: CreateOptions) -> CreatePlan:
    """Read what is needed (volume, catalog, account keys) and build the create body. Sends no write."""
    env = {"PUBLIC_KEY": read_public_key(options.ssh_public_key)} if options.ssh_public_key else {}
    required = client.network_volume(options.network_volume).data_center if options.network_volume else None
    catalog = fetch_catalog(client, options.gpu_type, options.count, options.cloud, options.min_cuda)
    _check_count(options, catalog)
    choice = choose_datacenter(catalog, options.datacenter, required)
    warnings = _ssh_warnings(client, options)
    if choice.availability is Availability.NONE:
        warnings.append(
            f"the catalog shows no stock for {catalog.describe()} in {choice.id}; RunPod will likely refuse the "
            "create (HTTP 400); `h3 pod catalog` lists data centers in stock"
        )
    request = CreatePodRequest(
        name=options.pod_name(),
        image=options.image,
        gpu=CreateGpu(id=options.gpu_type, count=options.count, min_cuda_version=options.min_cuda),
        cloud=options.cloud,
        data_center_ids=[choice.id],
        disk=options.disk_gb,
        ports=[SSH_PORT],
        env=env,
        mounts=options.mounts(),
        start_ssh=True,
    )
    return CreatePlan(request=request, datacenter=choice, catalog=catalog, warnings=warnings)


def create_pod(client: RunPodClient, plan: CreatePlan) -> Pod:
    """Send the planned create once. Costs money from this moment on."""
    return client.create_pod(plan.request)
