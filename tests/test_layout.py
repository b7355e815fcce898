"""The code's layout stays what docs/development.md ("How the code is organised") says: a small top level, imports
only going down the list of packages, no import circle, and old import paths still working."""

from __future__ import annotations

import ast
import importlib
import pathlib

import shardformer

ROOT = pathlib.Path(shardformer.__file__).parent
# lowest first: a package imports only packages before it (and itself)
ORDER = [
    "core",
    "context_parallel",
    "tensor_parallel",
    "pipeline",
    "data_parallel",
    "models",
    "policies",
    "expert_parallel",
    "api",
    "checkpoint",
    "engine",
    "integrations",
    "tools",
    "cli",
    "_compat",
    "__init__",
    "__main__",
]


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(("shardformer", *parts))
        out[name.removesuffix(".__init__") if parts[-1] == "__init__" else name] = path
    return out


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """Every shardformer module ``name`` imports, anywhere in its code (deferred imports included)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m.startswith("shardformer")}


def _level(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_top_level_holds_at_most_six_modules():
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top) <= 6, top


MAX_LINES = 400  # a file longer than this holds more than one topic: split it


def test_no_library_file_is_over_400_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in sorted(ROOT.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines (split each by topic): {long}"


def test_imports_only_go_down():
    modules = _modules()
    for name, path in modules.items():
        here = _level(name)
        for target in _imports(name, path):
            if target not in modules:
                continue  # a name imported from a module, counted through its module
            there = _level(target)
            assert ORDER.index(there) <= ORDER.index(here), f"{name} imports {target}: {there} is above {here}"


def test_no_import_circle():
    modules = _modules()
    graph = {name: {t for t in _imports(name, path) if t in modules and t != name} for name, path in modules.items()}
    # a package's __init__ importing its own submodules is how packages work, not a circle
    for name in graph:
        graph[name] = {t for t in graph[name] if not (t.startswith(name + ".") and modules[name].name == "__init__.py")}
    done, on_path = set(), []

    def visit(node):
        if node in on_path:
            raise AssertionError("import circle: " + " -> ".join(on_path[on_path.index(node) :] + [node]))
        if node in done:
            return
        on_path.append(node)
        for nxt in sorted(graph[node]):
            visit(nxt)
        on_path.pop()
        done.add(node)

    for node in sorted(graph):
        visit(node)


def test_old_import_paths_name_the_moved_modules():
    from shardformer import _compat

    for old, new in _compat.MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
    assert callable(shardformer.verify)  # the function, not the module of the same old name
    from shardformer.layers import Linear1D_Col, vocab_parallel_cross_entropy  # noqa: F401
    from shardformer.zero import ZeroOptimizer  # noqa: F401

    from shardformer.policies import Policy, get_autopolicy  # noqa: F401


def test_every_family_is_one_record():
    from shardformer.models import families, tiny_models

    names = [f.name for f in families()]
    assert {"GPT-2", "BERT", "ViT", "timm ViT"} <= set(names), names
    assert tiny_models() == ["bert-tiny", "gpt2-tiny", "timm-vit-tiny", "vit-tiny"]
