"""Policies derived from a model's own structure, for models with neither a built-in policy nor a
transformers plan: traced on a tiny copy, cut group by group, proven before use
(`shardformer.policies.proof`, as every route)."""

from shardformer.policies.derived.derive import NotDerivableError, NotProvenError, derive
from shardformer.policies.derived.policy import DerivedPolicy, derived_model

__all__ = ["DerivedPolicy", "NotDerivableError", "NotProvenError", "derive", "derived_model"]
