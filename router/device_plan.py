"""Which devices ``flashsplit up`` gives each worker: ``--device`` spread over the workers.

- no ``--device``: none given (each worker takes its own default, the CPU);
- one entry per worker or fewer (``cuda``, ``cuda:0,cuda:1``): worker ``i`` takes entry
  ``i`` modulo their count, prefill workers first, and a worker with ``--tp N`` puts its ranks on
  consecutive GPUs from there (``common.parallel.launch.rank_devices``). So ``--device cuda``
  with one prefill and one decode worker puts both on GPU 0, and ``cuda:0,cuda:1`` one on each;
- one entry per rank of every worker together, when some worker has ``--tp`` above 1
  (``--device cuda:0,cuda:1,cuda:2,cuda:3 --prefill-tp 2 --decode-tp 2``): each worker takes
  the next ``tp`` entries, so no two workers share a GPU. Without it, two TP workers given
  ``cuda`` would both start at GPU 0.
"""

from __future__ import annotations

from collections.abc import Sequence


def worker_devices(devices: Sequence[str], tps: Sequence[int]) -> list[str | None]:
    """Each worker's ``--device`` value (None: give none), for workers with these ``--tp``
    sizes, in order (prefill workers first). ValueError for an empty device name."""
    if any(not d.strip() for d in devices):
        raise ValueError(f"an empty device in {','.join(devices)!r}")
    if not devices:
        return [None] * len(tps)
    total = sum(tps)
    if len(devices) > 1 and any(tp > 1 for tp in tps) and len(devices) == total:
        out, start = [], 0
        for tp in tps:
            out.append(",".join(devices[start:start + tp]))
            start += tp
        return out
    if len(devices) > len(tps):
        raise ValueError(f"{len(devices)} devices for {len(tps)} workers of {total} ranks "
                         f"in all: give one per worker, or one per rank ({total})")
    return [devices[i % len(devices)] for i in range(len(tps))]
