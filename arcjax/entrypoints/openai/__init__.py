"""The OpenAI-compatible server (`arcjax serve`), a thin shell over `AsyncLLM`:
api_server.py (the app: routes, health, /metrics, auth, admission, drain, `serve`), one
serving module per endpoint (serving_completion.py, serving_chat.py, serving_models.py)
over what they share (serving_engine.py: preparing, queueing, collecting, streaming),
protocol.py (request parsing and validation, response bodies), http_server.py (errors, event
streams, disconnects, uvicorn), response_logprobs.py, server_metrics.py (Prometheus),
structured_fields.py (response_format / guided_* -> one constraint), tool_calls.py
(tool_choice -> constraint, tool_calls in responses) and tool_parsers/ (the formats models
emit tool calls in, one module each)."""
