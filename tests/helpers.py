"""Shared test utilities: compare sharded tensors and gradients against the unsharded module; the warnings
the quickstarts and examples may print."""

import re

import pytest
import torch
import torch.distributed as dist

from shardformer.core.compare import ATOL, GRAD_ATOL, GRAD_RTOL, RTOL  # the one fp32 tolerance table
from shardformer.tensor_parallel.slicer import gather_tensor, shard_spec

# The warnings a README/docs snippet (tests/test_snippets.py) or an example (tests/examples) may print on a
# clean run, each a pattern of the message with the reason it stays; any other one fails them.
EXPECTED_WARNINGS = {
    r"`is_gradient_checkpointing` is deprecated": (
        "PEFT 0.21.2 reads transformers' deprecated property in PeftModel's constructor (peft_model.py); "
        "every user of plain PEFT on transformers 5.24 sees it"
    ),
    r"BertForSequenceClassification LOAD REPORT": (
        "examples/bert puts a new classification head on the MiniLM encoder; transformers reports the head's "
        "weights as newly initialized (MISSING), which is where fine-tuning a classifier starts"
    ),
}


# The one warning a test that builds a PeftModel in its own process gets (the reason: EXPECTED_WARNINGS' first
# entry, PEFT reading transformers' deprecated property); marked on those tests, so that any other one shows
PEFT_READS_A_DEPRECATED_PROPERTY = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
)


def unexpected_warnings(printed: list[str]) -> list[str]:
    return [message for message in printed if not any(re.search(p, message) for p in EXPECTED_WARNINGS)]


def assert_close(actual, expected, atol=ATOL, rtol=RTOL, what=""):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def full_of(param_or_grad, spec_source=None, group=None):
    """The full tensor behind a (possibly sharded) parameter or its gradient."""
    spec = shard_spec(spec_source if spec_source is not None else param_or_grad)
    return param_or_grad if spec is None else gather_tensor(param_or_grad, spec, group)


def assert_grads_match(sharded: torch.nn.Module, full: torch.nn.Module, group=None, names=None):
    """Every parameter gradient of ``sharded``, gathered to full shape, equals ``full``'s."""
    full_params = dict(full.named_parameters())
    for name, p in sharded.named_parameters():
        if names is not None and name not in names:
            continue
        ref = full_params[name]
        assert (p.grad is None) == (ref.grad is None), f"{name}: grad presence differs"
        if p.grad is not None:
            assert_close(full_of(p.grad, p, group), ref.grad, GRAD_ATOL, GRAD_RTOL, f"grad of {name}")


def check_table(checks, world_size):
    """Parametrized tests, one per check, sharing one spawn per module and world size."""
    from shardformer.tools.testing import run_checks

    cache = {}

    def results():
        if "r" not in cache:
            try:
                cache["r"] = run_checks(checks, world_size)
            except Exception as e:  # the spawn itself failed: report it once per check, do not retry
                cache["r"] = {c.__name__: f"the spawn failed: {e}" for c in checks}
        return cache["r"]

    @pytest.mark.parametrize("name", [c.__name__ for c in checks])
    def test(name):
        error = results()[name]
        if error is not None:
            pytest.fail(f"{name} failed at tp={world_size}\n{error}", pytrace=False)

    return test


def world():
    return dist.get_world_size()


def rank():
    return dist.get_rank()


def saved_for_backward(model: torch.nn.Module, run):
    """``run()``'s result and the bytes autograd saves for the backward while it runs: every saved
    tensor, parameters aside, each storage counted once."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = run()
    return result, sum(storages.values())
