"""The connector's place in the package map: it imports no worker, role or launcher code
(vLLM loads it alone, in its own processes; our worker builds on it, not the reverse)."""

from __future__ import annotations

import ast
from pathlib import Path

import hybrid_pd

CONNECTOR = Path(hybrid_pd.__file__).resolve().parent / "connector"
FORBIDDEN = (
    "hybrid_pd.workers",
    "hybrid_pd.launcher",
    "hybrid_pd.prefill_worker",
    "hybrid_pd.decode_worker",
)


def _imported(tree: ast.AST, module: str) -> list[tuple[int, str]]:
    """(line, module) of every import in `tree`, relative ones resolved against `module`."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")[: -node.level]
                base = ".".join([*parent, base] if base else parent)
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return out


def _forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def test_the_connector_imports_no_worker_role_or_launcher_code():
    files = sorted(CONNECTOR.rglob("*.py"))
    assert len(files) > 10  # the scan sees the package, subpackages included
    root = CONNECTOR.parent.parent
    bad = []
    for path in files:
        rel = path.relative_to(root)
        module = ".".join(rel.with_suffix("").parts)
        if path.name == "__init__.py":
            module += ".__init__"  # relative imports resolve against the package itself
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, name in _imported(tree, module):
            if _forbidden(name):
                bad.append(f"{rel}:{line} imports {name}")
    assert not bad, "\n".join(bad)


def test_the_scan_catches_every_form_of_import():
    module = "hybrid_pd.connector.vllm.worker"
    for source in (
        "import hybrid_pd.workers.worker",
        "from hybrid_pd.launcher import cli",
        "from hybrid_pd import prefill_worker",
        "def f():\n    from hybrid_pd.decode_worker.role import DecodeRole",
        "from ...workers import worker",
    ):
        names = [n for _, n in _imported(ast.parse(source), module)]
        assert any(map(_forbidden, names)), source
    allowed = "from hybrid_pd.connector.setup import start_transport\nimport hybrid_pd.workersx"
    assert not any(_forbidden(n) for _, n in _imported(ast.parse(allowed), module))
