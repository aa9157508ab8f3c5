"""The package's shape, checked on its sources (no import, no GPU): the import graph has no cycle,
kernel modules never reach up to routing or the API, and the routing modules stay small."""

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[1] / "ffpa_cute"
# what a kernel module (a family's folder, common/) may never import: routing, launching, the API
UPWARD = {"ffpa_cute.dispatch", "ffpa_cute.interface", "ffpa_cute.launch", "ffpa_cute.ops",
          "ffpa_cute.precompile", "ffpa_cute.validate", "ffpa_cute.fallback"}


def _module(path: pathlib.Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> set[str]:
    """Package modules `path` imports anywhere in its body (function-level imports too)."""
    mod = _module(path)
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("ffpa_cute")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("ffpa_cute"):
                continue
            for a in node.names:  # `from . import x` imports the module x
                sub = f"{target}.{a.name}"
                out.add(sub if (PKG.parent / (sub.replace(".", "/") + ".py")).exists()
                        or (PKG.parent / sub.replace(".", "/")).is_dir() else target)
    return out - {mod}


GRAPH = {_module(p): _imports(p) for p in PKG.rglob("*.py")}


def test_no_import_cycle():
    """Tarjan-free check: a depth-first walk never meets a module on its own stack."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(GRAPH.get(m, ())):
            if n not in GRAPH:
                continue
            assert state.get(n) != "open", "import cycle: " + " -> ".join(
                stack[stack.index(n):] + [n])
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)


def test_kernel_modules_never_import_routing_or_the_api():
    for mod, deps in GRAPH.items():
        if mod.startswith(("ffpa_cute.sm", "ffpa_cute.common")):
            assert not deps & UPWARD, f"{mod} imports {sorted(deps & UPWARD)}"


def test_configs_import_no_cutlass():
    """Planning (dispatch, every family's config module) never loads cutlass: `import ffpa_cute`
    and `explain()` stay cheap, and precompile plans anywhere."""
    for path in [*PKG.glob("sm*/config.py"), PKG / "common/config.py", PKG / "dispatch.py",
                 PKG / "options.py"]:
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not any(x.split(".")[0] in ("cutlass", "cuda") for x in names), path


def test_routing_modules_stay_small():
    for name in ("interface.py", "dispatch.py"):
        n = len((PKG / name).read_text().splitlines())
        assert n <= 400, f"{name}: {n} lines"
