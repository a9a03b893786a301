"""The package map's import directions, read from the source with `ast` (imports inside
functions included): the shared worker plumbing (`workers/`) imports no role package, and
the proxy imports no launcher code."""

from __future__ import annotations

import ast
from pathlib import Path

import hybrid_pd
from tests.bench.test_layout import _imports

PACKAGE = Path(hybrid_pd.__file__).resolve().parent
#: What the plumbing must not reach: the role packages and their assembly.
ROLES = ("hybrid_pd.prefill_worker", "hybrid_pd.decode_worker", "hybrid_pd.roles")
#: The worker process's command-line entry, kept at its path: it may reach the assembly,
#: inside its `if __name__ == "__main__":` block only.
ENTRY = "hybrid_pd/workers/main.py"


def _under(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _main_block_imports(path: Path) -> set[str]:
    """Modules imported inside the file's `if __name__ == "__main__":` blocks."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        test = getattr(node, "test", None)
        if isinstance(node, ast.If) and ast.unparse(test) == "__name__ == '__main__'":
            for inner in ast.walk(node):
                if isinstance(inner, ast.ImportFrom):
                    names.add(inner.module or "")
                    names.update(f"{inner.module}.{a.name}" for a in inner.names)
                elif isinstance(inner, ast.Import):
                    names.update(a.name for a in inner.names)
    return names


def _offenders(package: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    files = sorted((PACKAGE / package).rglob("*.py"))
    assert len(files) >= 3, package  # the scan found the package
    out = {}
    for path in files:
        rel = str(path.relative_to(PACKAGE.parent))
        bad = {n for n, _ in _imports(path) if _under(n, forbidden)}
        if rel == ENTRY:
            bad -= _main_block_imports(path)
        if bad:
            out[rel] = sorted(bad)
    return out


def test_workers_import_no_role_package():
    assert _offenders("workers", ROLES) == {}


def test_the_entry_reaches_the_roles_only_when_run_as_a_program():
    entry = PACKAGE.parent / ENTRY
    assert "hybrid_pd.roles" in _main_block_imports(entry)
    module_level = [
        n
        for node in ast.parse(entry.read_text()).body
        if isinstance(node, ast.Import | ast.ImportFrom)
        for n in ([node.module] if isinstance(node, ast.ImportFrom) else [])
    ]
    assert not any(_under(n or "", ROLES) for n in module_level)


def test_the_proxy_imports_no_launcher_code():
    assert _offenders("proxy", ("hybrid_pd.launcher",)) == {}


def test_each_role_package_builds_its_worker_from_the_plumbing():
    """The roles reach the plumbing (not the reverse) and not each other."""
    for role, other in (("prefill_worker", "decode_worker"), ("decode_worker", "prefill_worker")):
        names = {n for p in (PACKAGE / role).rglob("*.py") for n, _ in _imports(p)}
        assert any(_under(n, ("hybrid_pd.workers",)) for n in names), role
        assert not any(_under(n, (f"hybrid_pd.{other}",)) for n in names), role


def test_the_scan_catches_a_role_import():
    tree = ast.parse("def f():\n    from hybrid_pd.decode_worker.role import DecodeRole\n")
    names = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert any(_under(n, ROLES) for n in names)


def _reaches_outside(package: str, allowed: tuple[str, ...]) -> dict[str, list[str]]:
    """Our modules that `package` imports outside `allowed` (itself always allowed)."""
    ours = tuple(f"hybrid_pd.{p}" for p in (package, *allowed))
    out = {}
    for path in sorted((PACKAGE / package).rglob("*.py")):
        bad = {
            n
            for n, _ in _imports(path)
            if _under(n, ("hybrid_pd",)) and n != "hybrid_pd" and not _under(n, ours)
        }
        if bad:
            out[str(path.relative_to(PACKAGE.parent))] = sorted(bad)
    return out


def test_the_proxy_api_and_kvcache_keep_to_their_imports():
    """proxy/ reaches proto/ and api/ only; api/ proto/ only; kvcache/ nothing of ours."""
    assert _reaches_outside("proxy", ("proto", "api")) == {}
    assert _reaches_outside("api", ("proto",)) == {}
    assert _reaches_outside("kvcache", ()) == {}
