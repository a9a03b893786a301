"""Prefill and decode workers: an engine, its connector role and gRPC services."""
