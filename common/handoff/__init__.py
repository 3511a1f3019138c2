"""The prefill -> decode handoff: what moves (``payload``, ``manifest``, ``layout``), how it is cut
into parts and checked on arrival (``parts``, ``stream``, ``ledger``, ``reservation``), the errors a
receiver answers with (``errors``), and the copies between pools and fields (``pools``). No grpc
here; the wire form is ``common/convert.py``. See docs/protocol.md."""
