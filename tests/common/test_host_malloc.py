"""glibc malloc settings for worker processes: applied where the C library is glibc, refused
with a clear error when out of range."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from common.host_malloc import HostMallocConfig


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_applies_on_glibc():
    # in a child process: the settings last for the life of the process that takes them
    code = ("from common.host_malloc import tune_host_malloc, HostMallocConfig\n"
            "assert tune_host_malloc()\n"
            "assert tune_host_malloc(HostMallocConfig(1 << 20, 0))\n"
            "b = [bytes(8 << 20) for _ in range(4)]\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("mmap, trim", [(0, 1), (64 << 20, 1), (1 << 20, -1)])
def test_out_of_range_settings_are_refused(mmap, trim):
    with pytest.raises(ValueError):
        HostMallocConfig(mmap_threshold_bytes=mmap, trim_threshold_bytes=trim)
