"""The package's layout (docs/design.md, "The map"): no import circle in kvtier/, counting
function-local imports too, and the C path does not import the pure-Python fallback."""
import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "kvtier"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict:
    """{module: set of kvtier modules it imports}, from every import statement anywhere in
    the module (top level, functions, try blocks). ``from kvtier.x import y`` counts as an
    import of kvtier.x.y when that is a module, else of kvtier.x; a package's parent
    packages (run by the import system first) are not edges."""
    files = {module_name(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                names = [f"{src}.{a.name}" if f"{src}.{a.name}" in files else src for a in node.names]
            else:
                continue
            for n in names:
                while n and n not in files:
                    n = n.rpartition(".")[0]
                if n and n != mod and not mod.startswith(n + "."):
                    edges.add(n)
        graph[mod] = edges
    return graph


def cycles(graph: dict) -> list:
    """Every strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_function_local_imports():
    g = import_graph()
    assert "kvtier.cli.bench_nodes" in g["kvtier.cli.bench"]  # a function-local import in cmd_bench
    assert "kvtier._blockio.records" in g["kvtier.fallback"]
    # a circle made up here is found
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_in_kvtier():
    assert cycles(import_graph()) == []


def test_each_room_imports_only_what_it_may():
    """The rooms of docs/design.md ("The map"): the block contract (_blockio) imports nothing
    else of kvtier; the fallback only the contract; the engine (_tier) only the contract,
    kvtier.io and itself; metrics the counters, not the engine; no library module imports
    the tools (cli), which may import the whole library."""
    g = import_graph()
    for mod, deps in g.items():
        if mod.startswith("kvtier._blockio"):
            assert all(d.startswith("kvtier._blockio") for d in deps), (mod, deps)
        if mod.startswith("kvtier._tier"):
            assert all(d.startswith(("kvtier._blockio", "kvtier._tier")) or d == "kvtier.io" for d in deps), (mod, deps)
        if not mod.startswith("kvtier.cli") and mod != "kvtier.__main__":
            assert not any(d.startswith("kvtier.cli") for d in deps), (mod, deps)
    assert all(d.startswith("kvtier._blockio") for d in g["kvtier.fallback"]), g["kvtier.fallback"]
    assert "kvtier._tier.engine" not in g["kvtier.metrics"]


def test_the_c_path_does_not_import_the_fallback(tmp_path):
    """After ``import kvtier.io`` and a tier with a deadline storing and loading on the C
    backend (its JobState takes the C core's CAS), kvtier.fallback is not imported."""
    pytest.importorskip("kvtier._C")
    code = textwrap.dedent("""
        import sys
        import numpy as np
        import kvtier.io as kio
        from kvtier.manager import FileSystemTierManager, TransferJob
        assert kio.backend == "c", kio.backend
        buf = np.arange(2 * 4096, dtype=np.uint32).view(np.uint8).reshape(8, 4096)
        m = FileSystemTierManager(buf, sys.argv[1], "m", checksum_blocks=True, io_timeout_s=30)
        keys = [(bytes([i]) * 16, 0) for i in range(2)]
        m.submit_store(TransferJob(1, keys, [0, 1]))
        assert m.drain_jobs(timeout=30)
        m.submit_load(TransferJob(2, keys, [2, 3]))
        assert m.drain_jobs(timeout=30)
        ok = [r.success for r in m.get_finished_jobs()]
        m.shutdown()
        print(ok, (buf[2:4] == buf[0:2]).all(), "kvtier.fallback" in sys.modules)
    """)
    env = {k: v for k, v in __import__("os").environ.items() if k != "KVTIER_IO_BACKEND"}
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["[True,", "True]", "True", "False"], r.stdout
