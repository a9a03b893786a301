"""OpenAI-compatible front door and the clients it uses to reach workers.

- `config.ProxyConfig`: what to serve and where the workers are (validated once).
- `routing`: the gRPC request pieces and `WorkerPool` (which worker runs what).
- `dispatch`: one request on the workers (prefill, retry, fallback, decode, abort).
- `app.build_app(config, pool)`: the FastAPI app (/v1/completions, /v1/chat/completions,
  /v1/models, /health, /metrics); `server.run_proxy` / `server.ProxyHandle` serve it.
"""
