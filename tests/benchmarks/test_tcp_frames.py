"""The frames benchmark measures plaintext and TLS on every connection count it reports."""

from __future__ import annotations

import json

from benchmarks import tcp_frames
from tests.tls_certs import make_pki


def test_rows_for_plaintext_and_tls(tmp_path, capsys):
    pki = make_pki(tmp_path / "pki")
    out = tmp_path / "frames.json"
    assert tcp_frames.main(["--mib", "4", "--frame-mib", "1", "--repeats", "1", "--tls-cert",
                            pki.server.cert, "--tls-key", pki.server.key, "--tls-ca", pki.ca,
                            "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["tls"], r["connections"]) for r in rows] == [(False, 1), (False, 2), (True, 1),
                                                          (True, 2)]
    assert all(r["frames"] == 4 and r["GBps"] > 0 for r in rows)
    assert capsys.readouterr().out.splitlines()[-1].startswith("wrote")
