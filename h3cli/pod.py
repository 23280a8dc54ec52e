"""`h3 pod`: RunPod pods — stock, a guarded create, get (with ssh/rsync lines), list, terminate."""

from __future__ import annotations

import pathlib
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from h3cli import options
from h3cli.output import Output
from h3core.errors import ConfigError
from h3core.pod import (
    DEFAULT_COUNT,
    DEFAULT_GPU_TYPE,
    DEFAULT_IMAGE,
    DEFAULT_MIN_CUDA,
    Catalog,
    Cloud,
    CreateOptions,
    CreateResult,
    PodList,
    PodReport,
    RunPodClient,
    TerminateResult,
    create_pod,
    fetch_catalog,
    parse_min_cuda,
    plan_create,
    pod_list,
    pod_report,
    preview_terminate,
    terminate,
)
from h3core.pod.access import get_pod_line
from h3core.pod.create import DEFAULT_DISK_GB, DEFAULT_MOUNT_PATH
from h3core.pod.models import Pod

app = typer.Typer(
    name="pod",
    help="RunPod pods: stock per data center, a guarded create, get (ssh/rsync lines), list, terminate. Needs RUNPOD_API_KEY.",
    no_args_is_help=True,
)

Count = Annotated[int, typer.Option("--count", min=1, help="GPUs on the pod (one machine).")]
GpuType = Annotated[str, typer.Option("--gpu-type", help="GPU type id from RunPod's catalog.")]
CloudOpt = Annotated[Cloud, typer.Option("--cloud", help="RunPod cloud tier.", case_sensitive=False)]
MinCuda = Annotated[str, typer.Option("--min-cuda", help="Lowest host CUDA version the image needs ('any': no floor).")]
Yes = Annotated[bool, typer.Option("--yes", help="Really do it (spends money / destroys data). Without it: show only, exit 2.")]
KeyFile = Annotated[
    Optional[pathlib.Path],
    typer.Option("--ssh-public-key", help="Public key file for SSH (put in PUBLIC_KEY). Default: the account's registered keys."),
]
PodId = Annotated[str, typer.Argument(help="Pod id, as `h3 pod list` shows it.", show_default=False)]


def _line(console: Console, label: str, value: object) -> None:
    console.print(f"  {label:<9} {value}", soft_wrap=True)


# --- catalog ---------------------------------------------------------------------------------------


def _render_catalog(cat: Catalog, console: Console) -> None:
    console.print(
        f"{cat.describe()} · {cat.memory_gb} GB each · list ${cat.price_per_gpu_hour:.2f}/GPU/h = "
        f"${cat.price_per_hour:.2f}/h · overall {cat.availability.value}",
        soft_wrap=True,
    )
    if not cat.in_stock():
        console.print(f"no data center has {cat.count} x this GPU in stock right now (largest machine: {cat.max_count} GPUs)")
        return
    table = Table(title_justify="left")
    for col in ("data center", "name", "stock"):
        table.add_column(col)
    for dc in cat.data_centers:
        table.add_row(dc.id, dc.name, dc.availability.value)
    console.print(table)


@app.command("catalog")
def catalog(
    count: Count = DEFAULT_COUNT,
    gpu_type: GpuType = DEFAULT_GPU_TYPE,
    cloud: CloudOpt = Cloud.SECURE,
    min_cuda: MinCuda = DEFAULT_MIN_CUDA,
    json: options.Json = False,
) -> None:
    """Stock per data center for COUNT GPUs of one type (default: 8 x RTX PRO 6000 Blackwell Server Edition)."""
    result = fetch_catalog(RunPodClient.from_env(), gpu_type, count, cloud, parse_min_cuda(min_cuda))
    Output(json).result(result, lambda console: _render_catalog(result, console))


# --- create ---------------------------------------------------------------------------------------


def _render_create(result: CreateResult, key_file: Optional[pathlib.Path], console: Console) -> None:
    plan, body = result.plan, result.plan.request
    cat = plan.catalog
    head = f"created pod {result.pod.id}" if result.pod else "would create (nothing sent):"
    console.print(head)
    _line(console, "name", body.name)
    _line(console, "gpus", f"{cat.describe()}, {cat.memory_gb} GB each")
    _line(console, "where", plan.datacenter.reason)
    _line(console, "price", f"${cat.price_per_hour:.2f}/h list ({body.gpu.count} x ${cat.price_per_gpu_hour:.2f}); billed while the pod exists")
    _line(console, "image", body.image)
    _line(console, "disk", f"{body.disk} GB container disk (wiped on restart)")
    _line(console, "storage", body.mounts.describe())
    key = f"PUBLIC_KEY from {key_file}" if key_file else "the account's registered SSH keys"
    _line(console, "ssh", f"{', '.join(body.ports)}, startSsh, {key}")
    if result.pod:
        console.print(f"next: {get_pod_line(result.pod.id)}   (poll until RUNNING; it prints the ssh and rsync lines)")


@app.command("create")
def create(
    count: Count = DEFAULT_COUNT,
    datacenter: Annotated[Optional[str], typer.Option("--datacenter", help="Data center id, e.g. US-KS-2. Default: the one with the most stock.")] = None,
    gpu_type: GpuType = DEFAULT_GPU_TYPE,
    cloud: CloudOpt = Cloud.SECURE,
    image: Annotated[str, typer.Option("--image", help="Container image (RunPod's CUDA 13.0 + torch 2.9.1 by default).")] = DEFAULT_IMAGE,
    name: Annotated[Optional[str], typer.Option("--name", help="Pod name. Default: h3-<count>gpu.")] = None,
    disk: Annotated[int, typer.Option("--disk", min=1, help="Container disk in GB.")] = DEFAULT_DISK_GB,
    volume_gb: Annotated[Optional[int], typer.Option("--volume-gb", help="Persistent workspace storage in GB (default 100; not with --network-volume).")] = None,
    network_volume: Annotated[Optional[str], typer.Option("--network-volume", help="Mount this existing network volume instead of persistent storage.")] = None,
    volume_mount_path: Annotated[str, typer.Option("--volume-mount-path", help="Where the storage is mounted in the pod.")] = DEFAULT_MOUNT_PATH,
    ssh_public_key: KeyFile = None,
    min_cuda: MinCuda = DEFAULT_MIN_CUDA,
    yes: Yes = False,
    json: options.Json = False,
) -> None:
    """Create a pod. Without --yes: print exactly what would be created and its price, send nothing, exit 2."""
    opts = CreateOptions.build(
        count=count, datacenter=datacenter, gpu_type=gpu_type, cloud=cloud, image=image, name=name, disk_gb=disk,
        volume_gb=volume_gb, network_volume=network_volume, mount_path=volume_mount_path,
        ssh_public_key=ssh_public_key, min_cuda=parse_min_cuda(min_cuda),
    )
    client = RunPodClient.from_env()
    plan = plan_create(client, opts)
    out = Output(json)
    for warning in plan.warnings:
        out.warn(warning)
    result = CreateResult(plan=plan, created=False)
    if yes:
        result = CreateResult(plan=plan, created=True, pod=create_pod(client, plan))
    out.result(result, lambda console: _render_create(result, ssh_public_key, console))
    if not yes:
        raise ConfigError(f"nothing created: add --yes to create this pod (about ${plan.price_per_hour:.2f}/h while it exists)")


# --- get / list -----------------------------------------------------------------------------------


def _gpu_text(pod: Pod) -> str:
    text = pod.gpu_text()
    utils = [g.util for g in (pod.runtime.gpus if pod.runtime else []) if g.util is not None]
    return text + (f" (util {', '.join(f'{u}%' for u in utils)})" if utils else "")


def _render_get(report: PodReport, console: Console) -> None:
    pod, access = report.pod, report.access
    console.print(f"pod {pod.id}  {pod.name}  {pod.status}")
    _line(console, "gpus", _gpu_text(pod))
    _line(console, "where", f"{pod.data_center_id or '-'} · {pod.cloud.value if pod.cloud else '-'} · host CUDA {pod.cuda_version or '-'}")
    _line(console, "cost", f"${pod.cost:.2f}/h" if pod.cost is not None else "-")
    _line(console, "image", pod.image or "-")
    _line(console, "storage", pod.mounts.describe() if pod.mounts else "-")
    if access.ssh:
        _line(console, "ssh", access.ssh)
        _line(console, "copy", f"{access.rsync_checkout}   # from the checkout's root")
        _line(console, "copy", f"{access.rsync_checkpoints}   # H3_MODEL_PATH / H3_TEXT_ENCODER_PATH / H3_*_VAE_PATH: the local files")
    elif access.proxy_ssh:
        _line(console, "ssh", f"{access.proxy_ssh}   # proxy: interactive shell only")
    if access.note:
        _line(console, "note", access.note)
    _line(console, "on pod", access.on_pod)


@app.command("get")
def get(pod_id: PodId, json: options.Json = False) -> None:
    """Status, GPUs, cost, and the ssh + rsync lines for one pod."""
    report = pod_report(RunPodClient.from_env(), pod_id)
    Output(json).result(report, lambda console: _render_get(report, console))


def _render_list(result: PodList, console: Console) -> None:
    if not result.pods:
        console.print("no pods")
        return
    table = Table()
    for col in ("id", "name", "status", "gpus", "data center", "$/h"):
        table.add_column(col)
    for pod in result.pods:
        cost = f"{pod.cost:.2f}" if pod.cost is not None else "-"
        table.add_row(pod.id, pod.name, pod.status, pod.gpu_text(), pod.data_center_id or "-", cost)
    console.print(table)


@app.command("list")
def list_(json: options.Json = False) -> None:
    """Every pod of the account."""
    result = pod_list(RunPodClient.from_env())
    Output(json).result(result, lambda console: _render_list(result, console))


# --- terminate ------------------------------------------------------------------------------------


def _render_terminate(result: TerminateResult, console: Console) -> None:
    if result.terminated:
        console.print(f"terminated pod {result.pod_id}")
        return
    pod = result.pod
    console.print(f"would terminate pod {pod.id}  {pod.name}  {pod.status}  {pod.gpu_text()}", soft_wrap=True)
    _line(console, "destroys", result.loses)


@app.command("terminate")
def terminate_(pod_id: PodId, yes: Yes = False, json: options.Json = False) -> None:
    """Terminate a pod (irreversible). Without --yes: show the pod and what it would destroy, exit 2."""
    client = RunPodClient.from_env()
    result = terminate(client, pod_id) if yes else preview_terminate(client, pod_id)
    Output(json).result(result, lambda console: _render_terminate(result, console))
    if not yes:
        raise ConfigError(f"nothing terminated: add --yes to terminate pod {pod_id}")


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="pod")
