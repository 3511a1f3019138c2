"""How `flashsplit up --mem-fraction` splits memory between the workers of one device."""

from __future__ import annotations

import pytest

from router.memory_shares import device_key, device_of, memory_shares


def worker(*args: str) -> list[str]:
    return ["-m", "decode_service", "--model", "tiny", "--port", "0", *args]


def test_two_workers_on_one_gpu_get_half_each():
    both = [worker("--device", "cuda"), worker("--device", "cuda:0")]
    assert memory_shares(both, 0.9) == [0.45, 0.45]


def test_workers_on_their_own_gpus_get_the_whole_fraction():
    apart = [worker("--device", "cuda:0"), worker("--device", "cuda:1")]
    assert memory_shares(apart, 0.9) == [0.9, 0.9]


def test_every_cpu_worker_shares_the_host():
    cpu = [worker(), worker("--device", "cpu"), worker("--device", "cuda:1")]
    assert memory_shares(cpu, 0.6) == [0.3, 0.3, 0.6]


def test_the_last_device_flag_is_the_one_a_worker_uses():
    assert device_of(worker("--device", "cuda:1", "--dtype", "bfloat16", "--device", "cuda:2")) \
        == "cuda:2"
    assert device_key("CUDA") == "cuda:0" and device_key("cpu:0") == "cpu"


def test_shares_never_add_up_to_more_than_the_fraction():
    six = [worker("--device", "cuda:0")] * 6
    shares = memory_shares(six, 1.0)
    assert sum(shares) <= 1.0 and shares[0] == pytest.approx(1 / 6, abs=1e-6)


@pytest.mark.parametrize("fraction", [0.0, 1.2])
def test_fractions_outside_zero_to_one_are_refused(fraction):
    with pytest.raises(ValueError, match="--mem-fraction"):
        memory_shares([worker()], fraction)


def test_a_tp_worker_counts_on_every_device_of_its_ranks():
    # prefill on cuda:0-1 (--tp 2), decode on cuda:1 alone: cuda:1 holds two workers
    workers = [worker("--tp", "2", "--device", "cuda"), worker("--device", "cuda:1"),
               worker("--device", "cuda:2,cuda:3", "--tp", "2")]
    assert memory_shares(workers, 0.8) == [0.4, 0.4, 0.8]


def test_a_tp_worker_on_the_cpu_is_one_worker_of_the_host():
    workers = [worker("--tp", "2"), worker("--tp", "4", "--device", "cpu")]
    assert memory_shares(workers, 0.5) == [0.25, 0.25]
