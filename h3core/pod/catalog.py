"""Stock per data center for one GPU type and count, and the choice of a data center from it."""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, computed_field

from h3core.errors import ConfigError, NoCapacity
from h3core.pod.client import RunPodClient
from h3core.pod.models import Availability, Cloud, CudaVersionAvailability, GpuType

DEFAULT_GPU_TYPE = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
DEFAULT_COUNT = 8
# RunPod's CUDA 13.0 image needs a host driver for CUDA >= 13.0; stock and placement use this floor.
DEFAULT_MIN_CUDA = "13.0"


class DataCenterStock(BaseModel):
    model_config = ConfigDict(frozen=True)

    id: str = Field(description="Data center id, e.g. US-KS-2.")
    name: str = Field(description="Human-readable name.")
    availability: Availability = Field(description="Stock for the asked GPU type and count.")


class Catalog(BaseModel):
    """What RunPod reports for `count` GPUs of one type on one cloud, best data center first."""

    model_config = ConfigDict(frozen=True)

    gpu_type: str = Field(description="GPU type id.")
    gpu_name: str = Field(description="Short name, e.g. 'RTX PRO 6000'.")
    memory_gb: int = Field(description="VRAM per GPU in GB.")
    count: int = Field(description="GPUs per pod the stock was asked for.")
    cloud: Cloud
    min_cuda: Optional[str] = Field(description="Host CUDA floor the stock was filtered by (None: any).")
    price_per_gpu_hour: float = Field(description="List price of one GPU, USD per hour, on this cloud.")
    max_count: int = Field(description="Largest machine of this type on this cloud (a ceiling, not stock).")
    availability: Availability = Field(description="Overall stock for this count and cloud.")
    data_centers: list[DataCenterStock] = Field(description="Per data center, most stock first, then by id.")
    cuda_versions: list[CudaVersionAvailability] = Field(description="Host CUDA versions and whether they have room.")

    @computed_field  # type: ignore[prop-decorator]
    @property
    def price_per_hour(self) -> float:
        """List price of the whole pod (count GPUs), USD per hour."""
        return round(self.price_per_gpu_hour * self.count, 4)

    def in_stock(self) -> list[DataCenterStock]:
        return [dc for dc in self.data_centers if dc.availability is not Availability.NONE]

    def stock_in(self, datacenter: str) -> Availability:
        """Stock in one data center; NONE when the catalog does not list it for this configuration."""
        return next((dc.availability for dc in self.data_centers if dc.id == datacenter), Availability.NONE)

    def describe(self) -> str:
        """'8 x NVIDIA RTX PRO 6000 Blackwell Server Edition on SECURE (hosts with CUDA >= 13.0)'."""
        cuda = f" (hosts with CUDA >= {self.min_cuda})" if self.min_cuda else ""
        return f"{self.count} x {self.gpu_type} on {self.cloud.value}{cuda}"


class DataCenterChoice(BaseModel):
    """The data center a create goes to, and why."""

    model_config = ConfigDict(frozen=True)

    id: str
    availability: Availability = Field(description="Its stock at the time of the catalog read.")
    reason: str = Field(description="One sentence: picked automatically (and over what), or asked for.")


def _ordered(gpu: GpuType) -> list[DataCenterStock]:
    stock = [DataCenterStock(id=dc.id, name=dc.name, availability=dc.availability) for dc in gpu.data_centers]
    return sorted(stock, key=lambda dc: (-dc.availability.rank, dc.id))


def fetch_catalog(
    client: RunPodClient,
    gpu_type: str = DEFAULT_GPU_TYPE,
    count: int = DEFAULT_COUNT,
    cloud: Cloud = Cloud.SECURE,
    min_cuda: Optional[str] = DEFAULT_MIN_CUDA,
) -> Catalog:
    """Read the catalog for `count` x `gpu_type` on `cloud` (one GET with retries)."""
    gpu = client.gpu_type(gpu_type, count=count, cloud=cloud, min_cuda=min_cuda)
    return Catalog(
        gpu_type=gpu.id,
        gpu_name=gpu.name,
        memory_gb=gpu.memory,
        count=count,
        cloud=cloud,
        min_cuda=min_cuda,
        price_per_gpu_hour=gpu.price.for_cloud(cloud),
        max_count=int(gpu.max_count.for_cloud(cloud)),
        availability=gpu.availability or Availability.NONE,
        data_centers=_ordered(gpu),
        cuda_versions=gpu.cuda_versions,
    )


def choose_datacenter(catalog: Catalog, requested: Optional[str] = None, required: Optional[str] = None) -> DataCenterChoice:
    """The asked-for data center, else the one with the most stock (ties: lowest id).

    `required` is the data center a network volume lives in: the pod must run there.
    Raises `ConfigError` when `requested` contradicts `required`, `NoCapacity` when nothing fits.
    """
    if requested and required and requested != required:
        raise ConfigError(
            f"the network volume is in {required} but --datacenter is {requested}; a pod can only mount a volume "
            f"in its own data center: use --datacenter {required}"
        )
    if requested:
        stock = catalog.stock_in(requested)
        return DataCenterChoice(id=requested, availability=stock, reason=f"{requested}: asked for with --datacenter")
    candidates = [dc for dc in catalog.in_stock() if required is None or dc.id == required]
    if not candidates:
        raise NoCapacity(_no_stock_line(catalog, required))
    best = candidates[0]
    others = ", ".join(f"{dc.id} {dc.availability.value}" for dc in candidates[1:])
    if required:
        why = f"the network volume's data center, {best.availability.value} stock"
    elif others:
        why = f"highest stock ({best.availability.value}) of {len(candidates)} data centers in stock; others: {others}"
    else:
        why = f"the only data center in stock ({best.availability.value})"
    return DataCenterChoice(id=best.id, availability=best.availability, reason=f"{best.id}: picked automatically, {why}")


def _no_stock_line(catalog: Catalog, required: Optional[str]) -> str:
    where = f"in {required} (the network volume's data center)" if required else "in any data center"
    hint = "try a smaller --count, --cloud COMMUNITY or another --gpu-type, or check again later (`h3 pod catalog`)"
    if catalog.count > catalog.max_count:
        hint = f"the largest {catalog.cloud.value} machine of this type has {catalog.max_count} GPUs; lower --count"
    return f"no stock for {catalog.describe()} {where} right now; {hint}"


def parse_min_cuda(text: Optional[str]) -> Optional[str]:
    """'13.0' -> '13.0'; 'any' (or empty) -> None (no host CUDA floor). Anything else is a `ConfigError`."""
    value = (text or "").strip().lower()
    if value in ("", "any", "none"):
        return None
    parts = value.split(".")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ConfigError(f"--min-cuda {text!r} is not a CUDA version like 13.0 (or 'any' for no floor)")
    return value
