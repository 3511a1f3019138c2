"""The handoff benchmark's whole handoffs, in plaintext and inside mutual TLS (every transport,
the send process's stream included), on the built-in tiny shape."""

from __future__ import annotations

import json

from benchmarks import handoff
from tests.tls_certs import make_pki


def test_whole_handoffs_over_each_transport_inside_tls(tmp_path):
    pki = make_pki(tmp_path / "pki")
    out = tmp_path / "handoff.json"
    base = ["--shapes", "tiny", "--lengths", "128", "--repeats", "1", "--tcp-connections", "1",
            "--byte-path-mib", "0", "--out", str(out)]
    tls = ["--tls-cert", pki.server.cert, "--tls-key", pki.server.key, "--tls-ca", pki.ca]
    assert handoff.main(base + tls + ["--transports", "stream,stream+process,tcp"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["transport"] for r in rows] == ["stream tls", "stream+process tls", "tcp x1 tls"]
    assert all(r["bytes"] > 0 and r["handoff_s"] > 0 for r in rows)
    assert handoff.main(base + ["--transports", "tcp"]) == 0
    assert [r["transport"] for r in json.loads(out.read_text())["rows"]] == ["tcp x1"]
