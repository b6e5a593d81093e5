"""Bad input gets a clear error naming the argument, in every family: each family's test module
declares ``bad_input_cases(xp)`` (call, exception, message pattern), run here without a GPU
(host arrays standing in for device ones, the launch plans built but not run) and on the GPU
(nothing launched, nothing recorded by the fault check)."""
from __future__ import annotations

import importlib

import numpy as np
import pytest

from arrays import raise_as_expected
from cukern import _registry

# Families whose bad-input cases live in a test of their own, with the reason.
ELSEWHERE = {
    "cross_entropy": "test_cross_entropy.py::test_bad_arguments_get_the_same_message_from_front_and_reference "
                     "(the front and the reference, with and without a GPU)",
}
FAMILIES = [f.name for f in _registry.families() if f.name not in ELSEWHERE]


def _cases(family: str, xp):
    return importlib.import_module(f"test_{family}").bad_input_cases(xp)


def test_every_family_declares_its_bad_inputs():
    names = {f.name for f in _registry.families()}
    assert set(ELSEWHERE) <= names
    for family in FAMILIES:
        assert hasattr(importlib.import_module(f"test_{family}"), "bad_input_cases"), family


@pytest.mark.parametrize("family", FAMILIES)
def test_bad_inputs_name_the_argument_without_a_gpu(family, host_arrays_as_device):
    cases = _cases(family, np)
    assert len(cases) >= 3
    raise_as_expected(cases)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_bad_inputs_name_the_argument(family):
    import cupy

    import cukern

    raise_as_expected(_cases(family, cupy))
    cukern.check_errors()   # (argument errors launch nothing and record nothing)
