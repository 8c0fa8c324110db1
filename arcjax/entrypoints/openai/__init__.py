"""The OpenAI-compatible server (`arcjax serve`), a thin shell over `AsyncLLM`:
api_server.py (the app: routes, health, /metrics, auth, admission, drain, `serve`), one
serving module per endpoint (serving_completion.py, serving_chat.py,
serving_tokenization.py, serving_models.py) over what they share (serving_engine.py:
preparing, queueing, collecting; streamed_choices.py: a response's choices and SSE body),
protocol.py (the request models, pydantic), request_params.py (requests -> SamplingParams
and template inputs), responses.py (response bodies, chunks, SSE), openapi.py
(/openapi.json, /docs), chat_output.py (reasoning, content and tool calls of a chat choice),
http_server.py (errors, event streams, disconnects, uvicorn), response_logprobs.py,
server_metrics.py and vllm_metrics.py (Prometheus), structured_fields.py (response_format /
guided_* -> one constraint), tool_calls.py (tool_choice -> constraint, tool_calls in
responses) and tool_parsers/ (the formats models emit tool calls in, one module each)."""
