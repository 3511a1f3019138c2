"""The metrics objects engines hold import neither grpc nor protobuf (engines never see them)."""

from __future__ import annotations

import subprocess
import sys


def test_the_metrics_objects_import_no_grpc_or_protobuf():
    code = ("import sys\n"
            "import common.metrics.prefill_metrics, common.metrics.decode_metrics\n"
            "import common.metrics.router_metrics, common.logging_setup\n"
            "print(sorted(m for m in sys.modules\n"
            "             if m.split('.')[0] == 'grpc' or m.startswith('google.protobuf')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout
