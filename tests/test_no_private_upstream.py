"""shardformer calls no private function of transformers, timm, peft, accelerate or trl.

Every file under ``shardformer/`` is parsed; a private name is one with a single leading underscore.
Flagged: an import of a private name or module of those packages; ``X._name(...)`` where ``X`` is one
of those packages, or any object and ``_name`` is not shardformer's own (a function or attribute
shardformer defines that is not an override of an upstream one); ``self._name(...)`` / ``super()._name(...)``
resolving, through the class's MRO, to an upstream class's method (a mixin's ``super()`` call, which
no MRO of its own resolves, counts as upstream); and ``getattr`` / ``hasattr`` / ``setattr`` naming a
private method of an upstream class. A private helper renamed upstream breaks a fresh install on its
next release: ``BertModel._create_attention_masks`` did (transformers 5.24). torch's own private
functions are a separate matter (:data:`TORCH`).
"""

import ast
import importlib
import inspect
from pathlib import Path

import shardformer

UPSTREAM = ("transformers", "timm", "peft", "accelerate", "trl")
ROOT = Path(shardformer.__file__).parent

# (file, private name): why no public API does the job. Keep it tiny; each entry is checked to be used.
ALLOWED = {
    ("integrations/trainer.py", "_save_rng_state"): (
        "ShardedTrainer's checkpoints add each rank's dropout generators to Trainer's RNG file; Trainer has no "
        "public hook that runs while its checkpoint folder is written and again when it is read back"
    ),
    ("integrations/trainer.py", "_load_rng_state"): "the other half of _save_rng_state",
    ("integrations/trainer.py", "_load_from_checkpoint"): (
        "Trainer's resume loads the weights itself; a sharded model's are loaded by shard_load, a PEFT adapter "
        "is left to Trainer's own load (no public way to hand a resume's weights over)"
    ),
    ("tensor_parallel/recompute.py", "_set_gradient_checkpointing"): (
        "activation checkpointing enabled by any route (gradient_checkpointing_enable before or after sharding, "
        "Trainer's gradient_checkpointing=True, reentrant or not) must replay the seeded dropout masks; "
        "transformers builds its checkpoint function there and nowhere public"
    ),
    ("tensor_parallel/lm_head.py", "_get_logits_processor"): (
        "the only place a logits processor runs after transformers' warpers (temperature, top-k, top-p); "
        "generate(logits_processor=...) runs before them, so a token agreed there is not drawn from the "
        "distribution generate samples"
    ),
}
# torch's private functions, called on torch objects (not what this test guards; listed to be seen).
TORCH = {
    "_assert_async": "the only assert a compiled graph keeps without a host sync (torch.compile)",
    "_patch_step_function": "torch.optim.Optimizer's step counting, which LR schedulers check",
}
_ATTRIBUTE_FUNCTIONS = ("getattr", "hasattr", "setattr", "delattr", "__setattr__")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _package(obj) -> str:
    return (getattr(obj, "__module__", None) or "").split(".")[0]


def _files():
    return sorted(p for p in ROOT.rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import(path: Path):
    """The module of ``path`` (``__main__`` only parsed: importing it runs the command line)."""
    return importlib.import_module(_module_name(path)) if path.name != "__main__.py" else None


def _classes() -> list[type]:
    """Every class defined in shardformer (its modules imported)."""
    found = []
    for path in _files():
        module = _import(path)
        if module is not None:
            found += [c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == module.__name__]
    return found


def _upstream_methods(classes) -> set[str]:
    """Private functions of the upstream classes shardformer's classes derive from, and of its roots."""
    import peft
    import timm.models.vision_transformer as timm_vit
    import transformers as tf

    roots = [tf.PreTrainedModel, tf.GenerationMixin, tf.Trainer, timm_vit.VisionTransformer, peft.PeftModel]
    methods = set()
    for cls in [*roots, *classes]:
        for klass in inspect.getmro(cls):
            if _package(klass) in UPSTREAM:
                methods |= {n for n, v in vars(klass).items() if _private(n) and callable(inspect.unwrap(v))}
    return methods


def _resolve(cls: type, name: str, after: bool) -> type | None:
    """The class of ``cls``'s MRO (after ``cls`` itself, for ``super()``) that defines ``name``."""
    mro = inspect.getmro(cls)
    return next((k for k in mro[1 if after else 0 :] if name in vars(k)), None)


class _Finder(ast.NodeVisitor):
    def __init__(self, module, own: set[str], upstream_methods: set[str]) -> None:
        self.module, self.own, self.upstream_methods = module, own, upstream_methods
        self.imports: dict[str, str] = {}  # local name -> the module or object path it was imported from
        self.classes: list[str] = []
        self.found: list[tuple[int, str, str]] = []  # (line, private name, what)

    def flag(self, node, name, what):
        self.found.append((node.lineno, name, what))

    def visit_Import(self, node):
        for alias in node.names:
            self.imports[alias.asname or alias.name.split(".")[0]] = alias.name
            if alias.name.split(".")[0] in UPSTREAM and any(map(_private, alias.name.split("."))):
                self.flag(node, alias.name, "import of a private module")

    def visit_ImportFrom(self, node):
        source = node.module or ""
        for alias in node.names:
            self.imports[alias.asname or alias.name] = f"{source}.{alias.name}"
            if source.split(".")[0] in UPSTREAM and (any(map(_private, source.split("."))) or _private(alias.name)):
                self.flag(node, f"{source}.{alias.name}", "import of a private name")

    def visit_ClassDef(self, node):
        self.classes.append(node.name)
        self.generic_visit(node)
        self.classes.pop()

    def _enclosing(self) -> type | None:
        obj = self.module
        for name in self.classes:
            obj = getattr(obj, name, None)
        return obj if inspect.isclass(obj) else None

    def visit_Call(self, node):
        func = node.func
        if isinstance(func, ast.Attribute) and _private(func.attr):
            self._attribute_call(node, func.value, func.attr)
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if called in _ATTRIBUTE_FUNCTIONS and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
            name = node.args[1].value
            if isinstance(name, str) and _private(name) and name in self.upstream_methods:
                self.flag(node, name, f"{called}() of an upstream private method")
        self.generic_visit(node)

    def _attribute_call(self, node, value, name):
        cls = self._enclosing()
        if isinstance(value, ast.Name) and value.id in ("self", "cls"):
            owner = _resolve(cls, name, after=False) if cls is not None else None
            if owner is not None and _package(owner) in UPSTREAM:
                self.flag(node, name, f"{value.id}.{name}() is {owner.__name__}'s")
            return
        if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "super":
            owner = _resolve(cls, name, after=True) if cls is not None else None
            if owner is None or _package(owner) in UPSTREAM:
                self.flag(node, name, f"super().{name}() is {getattr(owner, '__name__', 'the class mixed into')}'s")
            return
        source = self.imports.get(value.id, "") if isinstance(value, ast.Name) else ""
        if source.split(".")[0] == "torch":
            if name not in TORCH:
                self.flag(node, name, "torch private function not in TORCH")
            return
        if source.split(".")[0] in UPSTREAM or name not in self.own or name in self.upstream_methods:
            if name in TORCH:
                return  # torch's, called on a torch object (an optimizer)
            self.flag(node, name, "private function of another package")


def _own_names(classes) -> set[str]:
    """Private names shardformer defines itself, less overrides of upstream ones."""
    own = set()
    for path in _files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
    overrides = {
        name
        for cls in classes
        for name in vars(cls)
        if _private(name) and any(name in vars(k) and _package(k) in UPSTREAM for k in inspect.getmro(cls)[1:])
    }
    return {n for n in own if _private(n)} - overrides


def private_upstream_uses() -> dict[tuple[str, str], list[str]]:
    """{(file, private name): [where, what]} over every file of shardformer."""
    classes = _classes()
    own, methods = _own_names(classes), _upstream_methods(classes)
    uses: dict[tuple[str, str], list[str]] = {}
    for path in _files():
        finder = _Finder(_import(path), own, methods)
        finder.visit(ast.parse(path.read_text()))
        rel = path.relative_to(ROOT).as_posix()
        for line, name, what in finder.found:
            uses.setdefault((rel, name.rsplit(".", 1)[-1]), []).append(f"shardformer/{rel}:{line}: {name}: {what}")
    return uses


def test_no_private_upstream_calls_or_imports():
    uses = private_upstream_uses()
    bad = [where for key, found in sorted(uses.items()) if key not in ALLOWED for where in found]
    assert not bad, "private functions of transformers/timm/peft/accelerate/trl used:\n" + "\n".join(bad)
    stale = sorted(set(ALLOWED) - set(uses))
    assert not stale, f"ALLOWED entries no longer used (remove them): {stale}"


def test_the_finder_catches_what_it_guards():
    """A stage forward calling BertModel._create_attention_masks (as shardformer did until transformers
    5.24 changed it), a timm private, a private import, a mixin's super() call and a private method
    named to getattr are found; shardformer's own private helpers are not."""
    imports = "from transformers.modeling_utils import _init_weights\nimport shardformer.core.comm as comm\n"
    source = """
class Mixin:
    def generate(self):
        return super()._get_logits_processor(None)

def stage(model, b, hidden):
    b._create_attention_masks(attention_mask=None)
    model._pos_embed(hidden)
    getattr(model, "_set_gradient_checkpointing")
    comm._own_helper()
    return _own_helper(hidden)

def _own_helper(x):
    return x
"""
    module = type(importlib)("probe")
    exec(compile(source, "probe", "exec"), module.__dict__)  # the probe's classes, for MRO lookups
    classes = _classes()
    finder = _Finder(module, _own_names(classes) | {"_own_helper"}, _upstream_methods(classes))
    finder.visit(ast.parse(imports + source))
    names = sorted(name.rsplit(".", 1)[-1] for _, name, _ in finder.found)
    assert names == [
        "_create_attention_masks",
        "_get_logits_processor",
        "_init_weights",
        "_pos_embed",
        "_set_gradient_checkpointing",
    ], finder.found
