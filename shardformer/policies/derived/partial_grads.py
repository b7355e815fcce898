"""Which whole parameters a tensor-parallel cut leaves with a partial gradient on each rank.

A parameter left whole on every rank gets its whole gradient when what it computes reaches a
column projection (whose backward all-reduces its input's gradient) or the model's outputs. It
gets a part when what it computes meets only this rank's heads before a row projection: a relative
position table read inside the attention (SeamlessM4T's and Wav2Vec2-BERT's ``distance_embedding``),
a table the model computes once and hands to every block (SpeechT5's ``pe_k``, Bros's
``bbox_projection``), a per-head norm or scale between the queries and the attention. Each rank's
gradient then covers its own heads, and their sum over the tensor-parallel group is the whole one:
the module is given `GradAllReduce`. The traced origins (`.trace`) say which parameter reaches what;
one that reaches both kinds is left as it is (no sum is exact), and the proof refuses it by name.
"""

from __future__ import annotations

from collections import defaultdict

import torch.nn as nn

PARTIAL, WHOLE = "partial", "whole"


def _reached(flows, rules: dict, modules: dict) -> dict[str, set[str]]:
    """``{parameter: the kinds of gradient what it computes brings back}``, over every traced block
    and pooling head with a rule (rows: partial; columns, projections left whole, the outputs: whole)."""
    kinds: dict[str, set[str]] = defaultdict(set)
    for block, reads in flows.origins.items():
        rule = rules.get(type(modules[block]))
        for rel, origins in reads.items():
            kind = PARTIAL if rule is not None and rel in rule.rows | rule.inner_rows else WHOLE
            for name in origins:
                kinds[name].add(kind)
    for name in flows.output_origins:
        kinds[name].add(WHOLE)
    return kinds


def _cut_in(rule, rel: str) -> bool:
    """Whether the module at ``rel`` in a block of ``rule`` is cut (its parameters are each rank's own)."""
    cut = {
        *rule.cols,
        *rule.rows,
        *rule.inner_rows,
        *rule.channels,
        *rule.head_params,
        *rule.split_norms,
        *rule.feature_norms,
    }
    owners = {*rule.head_lists, *rule.attention}
    return rel in cut or any(rel == o or rel.startswith(f"{o}.") for o in owners)


def partial_modules(model: nn.Module, flows, rules: dict) -> tuple[dict[type, set[str]], set[str]]:
    """The modules whose every traced parameter of their own gets a partial gradient (else those
    parameters, by name): per block class, paths relative to the block (the same in every block of the
    class that runs it), and the modules outside every block (paths in ``model``)."""
    modules = dict(model.named_modules())
    kinds = _reached(flows, rules, modules)
    by_module: dict[str, set[str]] = defaultdict(set)
    for name, found in kinds.items():
        by_module[name.rpartition(".")[0]] |= found
    # a module whose own parameters differ (VideoPrism's pooling head: its query whole, its per-dim scale
    # partial): each partial one is summed by its own name
    params = {n for n, found in kinds.items() if found == {PARTIAL} and by_module[n.rpartition(".")[0]] != {PARTIAL}}
    by_module.update({name: {PARTIAL} for name in params})
    units = [b for b in [*flows.blocks, *flows.heads] if type(modules[b]) in rules]
    inside: dict[type, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    outside: set[str] = set()
    for path, found in by_module.items():
        unit = next((u for u in units if path == u or path.startswith(f"{u}.")), None)
        if unit is None:
            if found == {PARTIAL}:
                outside.add(path)
            continue
        rel = path[len(unit) + 1 :]
        rule = rules[type(modules[unit])]
        if not _cut_in(rule, rel.rpartition(".")[0] if path in params else rel):
            inside[type(modules[unit])][rel] |= found
    per_class = {cls: {rel for rel, found in rels.items() if found == {PARTIAL}} for cls, rels in inside.items()}
    return {cls: rels for cls, rels in per_class.items() if rels}, outside
