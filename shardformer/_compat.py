"""Old import paths keep working: ``import shardformer.layers``, ``from shardformer.zero import
ZeroOptimizer``, ``shardformer.slicer.gather_tensor``... name the modules that moved when the code was
grouped by technique and by model family. Each old name is the new module itself (not a copy), so
``isinstance`` checks and monkeypatching see one object."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

MOVED = {
    "shardformer.config": "shardformer.core.config",
    "shardformer.mesh": "shardformer.core.mesh",
    "shardformer.topology": "shardformer.core.record",
    "shardformer.rng": "shardformer.core.rng",
    "shardformer.layers": "shardformer.tensor_parallel.layers",
    "shardformer.layers.comm": "shardformer.core.comm",
    "shardformer.layers.sequence": "shardformer.tensor_parallel.sequence_regions",
    "shardformer.layers.linear": "shardformer.tensor_parallel.layers.linear",
    "shardformer.layers.embedding": "shardformer.tensor_parallel.layers.embedding",
    "shardformer.layers.dropout": "shardformer.tensor_parallel.layers.dropout",
    "shardformer.layers.loss": "shardformer.tensor_parallel.layers.loss",
    "shardformer.sharder": "shardformer.tensor_parallel.sharder",
    "shardformer.slicer": "shardformer.tensor_parallel.slicer",
    "shardformer.detect": "shardformer.tensor_parallel.detect",
    "shardformer.sequence_parallel": "shardformer.tensor_parallel.sequence_parallel",
    "shardformer.recompute": "shardformer.tensor_parallel.recompute",
    "shardformer.generation": "shardformer.tensor_parallel.lm_head",
    "shardformer.sharded_class": "shardformer.tensor_parallel.lm_head",
    "shardformer.policies.base": "shardformer.tensor_parallel.policy",
    "shardformer.policies.lm_heads": "shardformer.tensor_parallel.lm_head",
    "shardformer.policies.gpt2": "shardformer.models.gpt2",
    "shardformer.policies.bert": "shardformer.models.bert",
    "shardformer.policies.vit": "shardformer.models.vit",
    "shardformer.policies.timm_vit": "shardformer.models.timm_vit",
    "shardformer.policies.tp_plan.tiny": "shardformer.core.tiny",
    "shardformer.models.tiny": "shardformer.core.tiny",
    "shardformer.models.tiny_layers": "shardformer.core.tiny_layers",
    "shardformer.models.tiny_run": "shardformer.core.tiny_run",
    "shardformer.models.inputs": "shardformer.core.inputs",
    "shardformer.policies.tp_plan.check": "shardformer.tools.conformance",
    "shardformer.pipeline.families": "shardformer.models",
    "shardformer.zero": "shardformer.data_parallel",
    "shardformer.zero.comm": "shardformer.core.comm",
    "shardformer.zero.grad_norm": "shardformer.data_parallel.grad_norm",
    "shardformer.zero.layout": "shardformer.data_parallel.layout",
    "shardformer.zero.loss_scaler": "shardformer.data_parallel.loss_scaler",
    "shardformer.zero.optimizer": "shardformer.data_parallel.optimizer",
    "shardformer.zero.reducer": "shardformer.data_parallel.reducer",
    "shardformer.zero.state": "shardformer.data_parallel.state",
    "shardformer.zero.validate": "shardformer.data_parallel.validate",
    "shardformer.verify": "shardformer.tools.verify",
    "shardformer.verify_pipeline": "shardformer.tools.verify_pipeline",
    "shardformer.plan": "shardformer.tools.plan",
    "shardformer.activation_estimate": "shardformer.tools.activation_estimate",
    "shardformer.model_source": "shardformer.tools.model_source",
    "shardformer.testing": "shardformer.tools.testing",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=True)

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module) -> None:
        pass  # the new module is already loaded


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())  # before the path finder: an aliased package's __path__ would load copies
    # `shardformer.verify` is the function; the old module path must not replace it on the package
    sys.modules.setdefault("shardformer.verify", importlib.import_module(MOVED["shardformer.verify"]))
