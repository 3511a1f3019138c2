"""``flashsplit bench``: a serving benchmark against the gRPC API or any OpenAI-compatible
endpoint; see docs/bench.md."""
