"""A real worker process whose engine thread can be stopped from outside, with SIGUSR1.

``python -m tests.chaos.stoppable_prefill`` / ``stoppable_decode`` take the real workers'
flags and run the real services; SIGUSR1 stops every engine thread of the process, as a fault
that leaves the device unusable would. The worker must then report NOT_SERVING and exit
non-zero by itself, so that ``flashsplit up`` replaces it.
"""

from __future__ import annotations

import signal
import sys
import threading

from common.engine.loop import EngineLoop


def main(kind: str) -> None:
    engines: list[EngineLoop] = []
    start = EngineLoop.start

    def recording_start(self: EngineLoop) -> None:
        engines.append(self)
        start(self)

    # this process serves one worker: recording its engines here touches nothing else
    EngineLoop.start = recording_start

    def stop_engines(*_: object) -> None:
        for engine in engines:  # stop() joins the thread: not on the event loop's thread
            threading.Thread(target=engine.stop, daemon=True).start()

    signal.signal(signal.SIGUSR1, stop_engines)
    if kind == "prefill":
        from prefill_service.__main__ import main as serve
    else:
        from decode_service.__main__ import main as serve
    sys.exit(serve())
