"""The bench wing: every benchmark (`hybrid-pd bench ...`) and the harnesses they and the
tests share. Nothing in the product imports it; `hybrid-pd bench` reaches it through a lazy
import in launcher/cli.py, so no other command loads benchmark code. Imports nothing here:
`python -m hybrid_pd.bench.peer_vllm` runs under vLLM's own Python."""
