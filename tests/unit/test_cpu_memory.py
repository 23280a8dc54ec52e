"""The CPU allocator policy (h3core.runtime.cpu_memory): parsing, and that it really stops the page faults."""

import os
import subprocess
import sys
import textwrap

import pytest

from h3core.errors import ConfigError
from h3core.runtime import cpu_memory


def test_the_variable_picks_the_policy(monkeypatch):
    monkeypatch.delenv(cpu_memory.ALLOCATOR_ENV, raising=False)
    assert cpu_memory.requested() == "retain"
    monkeypatch.setenv(cpu_memory.ALLOCATOR_ENV, " System ")
    assert cpu_memory.requested() == "system"
    monkeypatch.setenv(cpu_memory.ALLOCATOR_ENV, "jemalloc")
    with pytest.raises(ConfigError, match="H3_CPU_ALLOCATOR='jemalloc'.*retain or system"):
        cpu_memory.requested()


# What the policy changes, checked where glibc puts a 64 MiB tensor (above its largest dynamic mmap
# threshold, 32 MiB): by default in its own mapping, returned to the kernel when freed (the next one
# faults in every page again); under the policy inside the heap, below the program break, and still
# resident after it is freed, ready for the next one.
_PLACEMENT = textwrap.dedent("""
    import ctypes, json, torch
    from h3core.runtime import cpu_memory

    libc = ctypes.CDLL(None)
    libc.sbrk.restype = ctypes.c_void_p

    def rss():
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) << 10

    def place():
        t = torch.empty(16 << 20).fill_(1.0)  # 64 MiB, every page touched
        in_heap = t.data_ptr() < libc.sbrk(0)
        before = rss()
        del t
        return {"in_heap": in_heap, "released": before - rss()}

    default = place()
    policy = cpu_memory.apply()
    print(json.dumps({"default": default, "policy": policy, "applied": place(), "again": cpu_memory.apply()}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc, sbrk and /proc: Linux")
def test_retain_keeps_a_freed_64_mib_tensor_mapped_in_the_heap():
    env = {k: v for k, v in os.environ.items() if k not in (cpu_memory.ALLOCATOR_ENV, "GLIBC_TUNABLES")}
    proc = subprocess.run([sys.executable, "-c", _PLACEMENT], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    import json

    result = json.loads(proc.stdout)
    # glibc is the C library of every Linux this project runs on (CI, RunPod images): the policy must
    # be in force there; off glibc it must say so rather than claim a policy it could not set
    expected = "retain" if cpu_memory._libc() is not None else "system (no glibc)"
    assert result["policy"] == expected, result
    if expected != "retain":
        return
    assert result["again"] == "retain"  # idempotent
    assert not result["default"]["in_heap"] and result["default"]["released"] > 60 << 20  # unmapped on free
    assert result["applied"]["in_heap"] and result["applied"]["released"] < 4 << 20  # kept for reuse


def test_system_keeps_glibc_defaults(monkeypatch):
    code = "from h3core.runtime import cpu_memory; print(cpu_memory.apply(), cpu_memory.policy())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, cpu_memory.ALLOCATOR_ENV: "system"}, timeout=60)
    assert proc.stdout.split() == ["system", "system"], proc.stderr
