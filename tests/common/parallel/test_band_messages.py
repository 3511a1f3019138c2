"""The reports of per-rank streams through the group's store: a wait for one handoff's keys
does not hold up another's on the same store object (a TCPStore client's own ``wait`` holds
its connection for the whole wait), reports are deleted once read, and a timeout deletes
nothing and says which keys it waited for."""

from __future__ import annotations

import datetime
import pickle
import threading
import time

import pytest
import torch.distributed as dist

from common.parallel.band_messages import take_reports, wait_for


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=30))


def test_a_slow_wait_does_not_hold_up_another(store):
    outcome = []

    def wait_slowly():
        try:
            wait_for(store, ["bands/slow"], 3.0)
        except TimeoutError:
            outcome.append("timed out")

    slow = threading.Thread(target=wait_slowly)
    slow.start()
    time.sleep(0.1)  # the slow one is waiting
    began = time.monotonic()
    threading.Timer(0.1, lambda: store.set("bands/fast", pickle.dumps("landed"))).start()
    assert take_reports(store, ["bands/fast"], 3.0) == ["landed"]
    assert time.monotonic() - began < 1.5
    slow.join()
    assert outcome == ["timed out"]


def test_reports_are_deleted_once_read(store):
    store.set("bands/a", pickle.dumps(1))
    store.set("bands/b", pickle.dumps(2))
    assert take_reports(store, ["bands/a", "bands/b"], 1.0) == [1, 2]
    assert store.num_keys() == 0


def test_a_timeout_deletes_nothing(store):
    store.set("bands/a", pickle.dumps(1))
    with pytest.raises(TimeoutError, match="bands/b"):
        take_reports(store, ["bands/a", "bands/b"], 0.2)
    assert store.check(["bands/a"]) and store.num_keys() == 1
