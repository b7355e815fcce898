"""The code's layout stays what docs/development.md ("How the code is organised") says: a small top level, imports
only going down the list of packages, no import circle, and old import paths still working."""

from __future__ import annotations

import ast
import importlib
import importlib.util
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
    "study",
    "api",
    "checkpoint",
    "engine",
    "integrations",
    "tools",
    "cli",
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


def test_one_import_path_per_module():
    """No aliases for the paths modules had before the code was grouped (the package has no release)."""
    for old in ("shardformer.layers", "shardformer.zero", "shardformer.slicer", "shardformer.testing"):
        assert importlib.util.find_spec(old) is None, old
    assert callable(shardformer.verify)  # the function (its module is shardformer.tools.verify)


# a lower package calls into a higher one only through the plug-in points it defines: the sharder calls the
# Policy it was given (the API lives in tensor_parallel, the routes' policies in policies), and the PEFT
# support registered with it (integrations)
PLUG_INS = {("tensor_parallel", "policies"), ("tensor_parallel", "integrations")}


def test_shard_model_studies_the_model_once_and_reads_it_going_down():
    """``shard_model`` studies the model once: the instance, its repeated blocks and its stacks are each
    worked out once per model however many routes, copies and techniques read them; and the journey
    through the packages goes down (no call climbs back to a package above the caller, beyond the
    plug-in points), in few moves between packages."""
    import sys
    from collections import Counter

    from transformers import LlamaConfig, LlamaForCausalLM

    from shardformer import ShardConfig, shard_model
    from shardformer.core import study_memo
    from shardformer.core.instance import study_instance
    from shardformer.models import family_of
    from shardformer.policies.anatomy import stacks
    from shardformer.policies.derived.blocks import repeated_blocks

    questions = {f.__wrapped__.__code__: f.__name__ for f in (study_instance, repeated_blocks, stacks, family_of)}
    asked, moves = Counter(), set()

    def package(frame):
        path = pathlib.Path(frame.f_code.co_filename)
        return path.relative_to(ROOT).with_suffix("").parts[0] if path.is_relative_to(ROOT) else None

    def follow(frame, event, arg):
        if event != "call" or package(frame) is None:
            return
        if frame.f_code in questions:
            asked[questions[frame.f_code], id(frame.f_locals["model"])] += 1
        caller = frame.f_back  # the memo's wrapper is not a step of the journey: its caller asks
        while caller is not None and (package(caller) is None or caller.f_code.co_filename == study_memo.__file__):
            caller = caller.f_back
        if caller is not None and package(caller) != package(frame):
            moves.add((package(caller), package(frame)))

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    model = LlamaForCausalLM(config)
    sys.setprofile(follow)
    try:
        shard_model(model, ShardConfig(tensor_parallel_size=1))
    finally:
        sys.setprofile(None)
    assert {name for name, _ in asked} == set(questions.values()), asked
    assert max(asked.values()) == 1, asked
    assert model.shardformer.study.layer_stack == "model.layers"
    climbs = {(a, b) for a, b in moves if ORDER.index(b) > ORDER.index(a)}
    assert climbs <= PLUG_INS, climbs
    assert len(moves) <= 16, sorted(moves)


def test_every_family_is_one_record():
    from shardformer.models import families, tiny_models

    names = [f.name for f in families()]
    assert {"GPT-2", "BERT", "ViT", "timm ViT"} <= set(names), names
    assert tiny_models() == ["bert-tiny", "gpt2-tiny", "timm-vit-tiny", "vit-tiny"]
