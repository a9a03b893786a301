"""These tests run under a Python that has vLLM (its own venv, see docs/vllm.md);
tests/connector/test_vllm.py runs them from the main suite. Elsewhere they are not
collected."""

import importlib.util

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]
