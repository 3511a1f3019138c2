"""``python -m tests.router.fake_prefill``: see fake_worker.py."""

from tests.router.fake_worker import main

if __name__ == "__main__":
    main("prefill")
