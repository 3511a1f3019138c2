"""``common/`` sits below the services and the router: no module of it imports
``prefill_service``, ``decode_service`` or ``router``, at the top or lazily inside a function.
What only a service can do (a follower's band sender or receiver) is handed down to common as
a factory by the service's ``__main__``.

The check is the one ``tests/common/ops/layering`` runs on ``common/ops``: it reads the source,
so it sees imports anywhere in a module, relative ones, and module names in string tables.
"""

from __future__ import annotations

from pathlib import Path

from tests.common.ops.layering.test_layering import climbs

COMMON = Path(__file__).resolve().parents[2] / "common"
ABOVE_COMMON = ("prefill_service", "decode_service", "router")


def test_common_imports_nothing_above_it():
    assert (COMMON / "parallel").is_dir()
    assert climbs(COMMON, "common", ABOVE_COMMON) == []


def test_the_check_sees_a_lazy_import_of_a_service(tmp_path):
    """A function-local import of a service module (how a follower once made its band
    receiver) is found; a docstring naming one and an import within common are not."""
    pkg = tmp_path / "common"
    (pkg / "parallel").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "parallel" / "__init__.py").write_text("")
    (pkg / "parallel" / "bands.py").write_text(
        '"""Frames land through decode_service.band_receiver."""\n'
        "from common.parallel.rank_streams import bands_to\n"
        "def open_receiver():\n"
        "    from decode_service.band_receiver import BandReceiver\n"
        "    import prefill_service.band_sender\n"
        "    from router import cli\n")
    assert climbs(pkg, "common", ABOVE_COMMON) == [
        "parallel/bands.py: decode_service.band_receiver",
        "parallel/bands.py: prefill_service.band_sender",
        "parallel/bands.py: router",
    ]
