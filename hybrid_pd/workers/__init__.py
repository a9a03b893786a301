"""Prefill and decode workers: an engine, its connector role and gRPC services."""

#: Requests admitted but not yet given their first token, per worker; beyond this new ones
#: are refused with RESOURCE_EXHAUSTED (the proxy holds them or tries another worker).
#: Here, not in worker.py, so that `serve` reads it without importing torch.
DEFAULT_MAX_QUEUED = 256
