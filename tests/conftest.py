"""Test tiers by folder: unit (CPU, fast), dist (spawned Gloo ranks), cli (the h3 command), gpu (CUDA)."""

from __future__ import annotations

import pathlib

import pytest

_TIERS = {"dist": pytest.mark.dist, "cli": pytest.mark.cli, "gpu": pytest.mark.gpu}


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = pathlib.Path(str(item.fspath)).parent.name
        if tier in _TIERS:
            item.add_marker(_TIERS[tier])
