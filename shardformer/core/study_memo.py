"""One answer per model and question while a model is studied.

``shard_model`` and ``ParallelEngine`` study the model the user passed once, before anything is cut;
the derivation, the proofs, the anatomy and the pipeline split all ask the same questions of it
(what the instance adds, where its repeated blocks are, where its stacks are). Inside
`studied_once` each question decorated with `once_per_study` is answered once per model
and every asker reads that answer; outside, every call answers anew, since the user may change the
model between calls."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable
from typing import TypeVar

import torch.nn as nn

T = TypeVar("T")
_STUDIES: list[dict] = []  # per studied_once block: {question: {model: answer}} (weak: copies die freely)


@contextlib.contextmanager
def studied_once():
    """Within the block, each `once_per_study` question is answered once per model (the outermost
    block holds the answers: a nested call reads its caller's study)."""
    _STUDIES.append({})
    try:
        yield
    finally:
        _STUDIES.pop()


def once_per_study(question: Callable[[nn.Module], T]) -> Callable[[nn.Module], T]:
    """``question(model)`` answered once per model inside `studied_once`, anew outside."""

    @functools.wraps(question)
    def answer(model: nn.Module) -> T:
        if not _STUDIES:
            return question(model)
        answers = _STUDIES[0].setdefault(question, weakref.WeakKeyDictionary())
        if model not in answers:
            answers[model] = question(model)
        return answers[model]

    return answer
