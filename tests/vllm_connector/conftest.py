"""These tests run under a Python that has vLLM (its own venv, see docs/vllm.md);
tests/connector/test_vllm.py runs them from the main suite. Elsewhere they are not
collected."""

import importlib.util
import os

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]

# Tensor-parallel vLLM servers take minutes per request on a 2-core machine (test_tp.py),
# their ranks sharing the cores (docs/vllm.md, "Tensor parallelism", says what that cost
# before idle steps waited on every rank): collected only when asked for, so the suite that
# runs everything else skips nothing.
if os.environ.get("HYBRID_PD_VLLM_TP") != "1":
    collect_ignore = [*globals().get("collect_ignore", []), "test_tp.py", "test_serve_tp.py"]
