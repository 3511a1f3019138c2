"""Test-wide setup: seeded RNGs, GPU tests skipped where there is no CUDA device, metric records.

Where there is no CUDA device, TRITON_INTERPRET=1 is set here, before any test imports a kernel
module: our Triton kernels then run on CPU tensors in Triton's interpreter
(``tests/common/ops/test_triton_interpreter.py``).
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from common.training.transformers_import import import_modeling_without_fla


def _cuda_available() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:  # a broken driver install counts as no GPU
        return False


if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# transformers is the oracle and runs on CPU tensors: its GDN layers must take the plain-torch
# path even where fla is installed, while fla stays importable for our own GPU kernels
import_modeling_without_fla()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not a param id "gpu"
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """With FLASHSPLIT_INSTANT_FAILURES=1 (``benchmarks/gpu_tests.sh``), a failure's traceback
    is printed as it happens: a run its time limit kills never reaches pytest's summary."""
    if report.failed and os.environ.get("FLASHSPLIT_INSTANT_FAILURES") == "1":
        print(f"\nFAILED {report.nodeid} ({report.when})\n{report.longreprtext}", flush=True)


@pytest.fixture(autouse=True)
def _seed_rngs():
    """Every test starts from the same global RNG state, whatever ran before it."""
    random.seed(0)
    torch.manual_seed(0)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(0)
    yield


@pytest.fixture
def record_metric(request):
    """``record_metric(name, value)``: print an accuracy figure and, when FLASHSPLIT_TEST_METRICS
    names a file, append it there as a JSON line (test id, name, value)."""
    path = os.environ.get("FLASHSPLIT_TEST_METRICS")

    def record(name: str, value) -> None:
        value = float(value) if isinstance(value, (int, float)) or torch.is_tensor(value) else value
        print(f"[metric] {request.node.nodeid} {name} = {value}")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"test": request.node.nodeid, "name": name, "value": value}) + "\n")

    return record
