"""`hybrid-pd bench proxy`: a real worker and the proxy as a process of its own."""

from __future__ import annotations

import json

import pytest

from hybrid_pd.launcher.cli import main

pytestmark = pytest.mark.timeout(180)


def test_bench_proxy_json(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID_PD_CACHE", str(tmp_path))
    assert main(["bench", "proxy", "--prompt-mb", "2", "--reps", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["huge_prompt_status"] == [400]  # refused: far past max_model_len
    assert result["torch_mapped"] is False
    assert 0 < result["proxy_rss_mib"] < 400
    assert result["models_calls"] >= 1 and result["models_max_ms"] > 0
    assert main(["bench", "proxy", "--prompt-mb", "100"]) == 2
    assert "--prompt-mb must be in" in capsys.readouterr().err
