"""The committed stubs in common/pb/ are exactly what proto/generate.py makes from proto/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "common" / "pb"


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def test_stubs_are_fresh(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True, text=True)
    fresh, committed = _files(tmp_path), _files(COMMITTED)
    stale = sorted(name for name in fresh.keys() | committed.keys()
                   if fresh.get(name) != committed.get(name))
    assert not stale, f"common/pb/ is stale ({', '.join(stale)}): run `make proto`"


def test_stubs_import_as_package():
    from common.pb.flashsplit.v1 import decode_pb2_grpc, generation_pb2_grpc, prefill_pb2_grpc

    assert hasattr(generation_pb2_grpc, "GenerationServicer")
    assert hasattr(prefill_pb2_grpc, "PrefillStub") and hasattr(decode_pb2_grpc, "DecodeStub")
