"""HTTP in and SSE out: the OpenAI-compatible API."""
