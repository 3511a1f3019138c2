"""The router's OpenAI-compatible HTTP API (``--http-port``); see docs/http.md."""
