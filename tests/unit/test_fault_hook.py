"""H3_INJECT_FAULT parsing and matching (the hook the fault tests drive)."""

import pytest

from h3core.errors import ConfigError
from h3core.runtime import faults
from h3core.runtime.faults import FAULT_ENV, FaultSpec, maybe_inject_fault, parse_fault_specs


def test_parse_forms():
    assert parse_fault_specs("step:2@1") == [FaultSpec("step", 2, 1, "raise")]
    assert parse_fault_specs("step:2@1:kill, iter@*:exit") == [
        FaultSpec("step", 2, 1, "kill"),
        FaultSpec("iter", None, None, "exit"),
    ]
    assert parse_fault_specs("step:*@0:config") == [FaultSpec("step", None, 0, "config")]


@pytest.mark.parametrize("text", ["step:2", "step:2@", "@1", "step:x@1", "step:2@1:explode", "step:2@one"])
def test_malformed_is_a_config_error_naming_the_variable(text):
    with pytest.raises(ConfigError) as err:
        parse_fault_specs(text)
    assert FAULT_ENV in str(err.value) and "\n" not in str(err.value)


def test_matching():
    spec = FaultSpec("step", 2, 1)
    assert spec.matches("step", 1, 2)
    assert not spec.matches("step", 0, 2)
    assert not spec.matches("step", 1, 3)
    assert not spec.matches("iter", 1, 2)
    assert FaultSpec("step", None, None).matches("step", 5, 9)


def test_hook_is_a_no_op_when_unset(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "step:2@1")
    with pytest.raises(RuntimeError):
        maybe_inject_fault("step", 1, 2)  # armed, the point fails (and its spec is cached)
    monkeypatch.delenv(FAULT_ENV)
    monkeypatch.setattr(faults, "parse_fault_specs", lambda text: pytest.fail(f"parsed {text!r} with the variable unset"))
    assert maybe_inject_fault("step", 1, 2) is None  # unset: the same point passes; nothing is parsed, the cache is not used


def test_hook_raises_at_the_named_point_only(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "step:2@1")
    maybe_inject_fault("step", 0, 2)
    maybe_inject_fault("step", 1, 1)
    with pytest.raises(RuntimeError, match="injected fault at step 2 on rank 1"):
        maybe_inject_fault("step", 1, 2)


def test_config_action_raises_a_config_error(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "load@0:config")
    with pytest.raises(ConfigError) as err:
        maybe_inject_fault("load", 0)
    assert err.value.exit_code == 2
