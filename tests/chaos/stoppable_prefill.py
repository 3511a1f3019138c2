"""``python -m tests.chaos.stoppable_prefill``: see stoppable_worker.py."""

from tests.chaos.stoppable_worker import main

if __name__ == "__main__":
    main("prefill")
