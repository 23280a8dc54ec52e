"""The CPU allocator policy (h3core.cpu_memory): parsing, and that it really stops the page faults."""

import os
import subprocess
import sys
import textwrap

import pytest

from h3core import cpu_memory
from h3core.errors import ConfigError


def test_the_variable_picks_the_policy(monkeypatch):
    monkeypatch.delenv(cpu_memory.ALLOCATOR_ENV, raising=False)
    assert cpu_memory.requested() == "retain"
    monkeypatch.setenv(cpu_memory.ALLOCATOR_ENV, " System ")
    assert cpu_memory.requested() == "system"
    monkeypatch.setenv(cpu_memory.ALLOCATOR_ENV, "jemalloc")
    with pytest.raises(ConfigError, match="H3_CPU_ALLOCATOR='jemalloc'.*retain or system"):
        cpu_memory.requested()


# A 64 MiB tensor, freed and made again: above glibc's largest dynamic mmap threshold (32 MiB), so by
# default every page of it faults again each time; with the policy the heap keeps it mapped.
_FAULTS = textwrap.dedent("""
    import json, resource, sys, torch
    from h3core import cpu_memory

    def faults_of_a_fresh_tensor():
        torch.empty(16 << 20).fill_(1.0)  # once, so that the next one can reuse it
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty(16 << 20).fill_(1.0)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    default = faults_of_a_fresh_tensor()
    policy = cpu_memory.apply()
    print(json.dumps({"default": default, "policy": policy, "applied": faults_of_a_fresh_tensor(), "again": cpu_memory.apply()}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and ru_minflt: Linux")
def test_retain_stops_the_page_faults_of_a_fresh_64_mib_tensor():
    env = {k: v for k, v in os.environ.items() if k != cpu_memory.ALLOCATOR_ENV}
    proc = subprocess.run([sys.executable, "-c", _FAULTS], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    import json

    result = json.loads(proc.stdout)
    if result["policy"] != "retain":
        pytest.skip(f"no glibc mallopt here: {result['policy']}")
    assert result["again"] == "retain"  # idempotent
    assert result["default"] > 10_000  # 16,384 pages of 4 KiB fault by default (fewer with huge pages)
    assert result["applied"] < result["default"] / 100


def test_system_keeps_glibc_defaults(monkeypatch):
    code = "from h3core import cpu_memory; print(cpu_memory.apply(), cpu_memory.policy())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, cpu_memory.ALLOCATOR_ENV: "system"}, timeout=60)
    assert proc.stdout.split() == ["system", "system"], proc.stderr
