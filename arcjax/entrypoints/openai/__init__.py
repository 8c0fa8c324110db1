"""The OpenAI-compatible server (`arcjax serve`), a thin shell over `AsyncLLM`:
api_server.py (the app, its routes, `serve`), protocol.py (request parsing, response
bodies), http_server.py (body limits, event streams, uvicorn), response_logprobs.py,
server_metrics.py (Prometheus), structured_fields.py (response_format / guided_* -> one
constraint), tool_calls.py (tool_choice -> constraint, tool_calls in responses) and
tool_parsers/ (the formats models emit tool calls in)."""
