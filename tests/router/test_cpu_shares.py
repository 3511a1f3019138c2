"""router/cpu_shares.py: how `flashsplit up` divides the host's CPUs between CPU workers."""

from __future__ import annotations

from router.cpu_shares import cpu_thread_shares

CPU = ("--device", "cpu")


def test_two_cpu_workers_get_half_the_host_each():
    assert cpu_thread_shares([CPU, CPU], 16) == [8, 8]
    assert cpu_thread_shares([(), ()], 2) == [1, 1]  # the CPU is the default device


def test_every_worker_gets_at_least_one_thread():
    assert cpu_thread_shares([CPU] * 3, 2) == [1, 1, 1]


def test_gpu_workers_are_left_alone():
    assert cpu_thread_shares([("--device", "cuda"), CPU], 16) == [None, 16]
    assert cpu_thread_shares([("--device", "cuda:0"), ("--device", "cuda:1")], 16) == [None, None]


def test_a_tp_worker_takes_a_share_per_rank():
    assert cpu_thread_shares([CPU + ("--tp", "2"), CPU], 12) == [8, 4]


def test_a_worker_given_a_count_keeps_it_and_the_others_share_what_is_left():
    given = CPU + ("--cpu-threads", "6")
    assert cpu_thread_shares([given, CPU, CPU], 16) == [None, 5, 5]
    # 0 asks for every CPU: kept as given, and takes nothing from the others' share
    assert cpu_thread_shares([CPU + ("--cpu-threads", "0"), CPU], 8) == [None, 8]
    assert cpu_thread_shares([given, given], 16) == [None, None]


def test_the_last_flags_are_the_ones_a_worker_uses():
    assert cpu_thread_shares([("--device", "cuda", "--device", "cpu"), CPU], 4) == [2, 2]
    assert cpu_thread_shares([CPU + ("--cpu-threads", "2", "--cpu-threads", "3"), CPU],
                             8) == [None, 5]
