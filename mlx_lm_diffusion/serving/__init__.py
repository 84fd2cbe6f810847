"""The OpenAI-compatible HTTP server and everything only it uses: request parsing, routes, scheduling, streaming."""
