"""The bench wing stays a wing: no product module imports `hybrid_pd.bench` (read from the
source with `ast`, imports inside functions included), and the command line reaches it only
when `hybrid-pd bench` is parsed."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import hybrid_pd

PACKAGE = Path(hybrid_pd.__file__).resolve().parent
BENCH = "hybrid_pd.bench"
#: The one product module that reaches the wing, lazily: the `hybrid-pd bench` command.
CLI = "hybrid_pd/launcher/cli.py"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, bool]]:
    """Every module `path` imports, by its full name (`from a import b` gives a and a.b, since
    b may be a module; relative imports resolved), each with whether the import runs inside
    a function (lazily) rather than when the module loads."""
    package = _module_name(path)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((alias.name, lazy) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((base, lazy))
            found.extend((f"{base}.{alias.name}", lazy) for alias in node.names)
        inner = lazy or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


def _is_bench(name: str) -> bool:
    return name == BENCH or name.startswith(BENCH + ".")


def test_no_product_module_imports_the_bench_wing():
    """Outside bench/ only launcher/cli.py names it, and only inside the function that
    fills the `bench` command's parser."""
    bench_dir = PACKAGE / "bench"
    product = [p for p in sorted(PACKAGE.rglob("*.py")) if bench_dir not in p.parents]
    assert len(product) > 50  # the scan found the package
    offenders = {}
    for path in product:
        name = str(path.relative_to(PACKAGE.parent))
        bench = [(n, lazy) for n, lazy in _imports(path) if _is_bench(n)]
        if name == CLI:
            bench = [(n, lazy) for n, lazy in bench if not lazy]
        if bench:
            offenders[name] = sorted(bench)
    assert offenders == {}


def test_the_scan_sees_lazy_imports():
    """The check above reads imports inside functions too: it finds the command line's."""
    found = _imports(PACKAGE.parent / CLI)
    assert ("hybrid_pd.bench.cli", True) in found
    assert ("hybrid_pd.launcher.console", False) in found


def test_only_the_bench_command_imports_the_bench_wing():
    code = textwrap.dedent(
        """
        import sys
        from hybrid_pd.launcher.cli import build_parser

        def bench_modules():
            return sorted(m for m in sys.modules if m == "hybrid_pd.bench"
                          or m.startswith("hybrid_pd.bench."))

        for argv in (["serve"], ["proxy", "--decode", "127.0.0.1:1"], ["plan", "--list"]):
            build_parser().parse_args(argv)
            assert not bench_modules(), (argv, bench_modules())
        args = build_parser().parse_args(["bench", "kvcache", "--requests", "10"])
        assert args.command == "bench" and args.bench == "kvcache" and callable(args.func)
        assert "hybrid_pd.bench.cli" in bench_modules()
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=PACKAGE.parent,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
