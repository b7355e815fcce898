"""A speech encoder proven at tp=2 on the recipe's audio inputs: a tiny wav2vec2 with a CTC head (a
waveform through its convolutional feature encoder, a transcript for the CTC loss) sharded by the
derived route against its unsharded copy (``verify``: outputs, loss, every gradient, the weights and
outputs after a step). One spawn."""

from __future__ import annotations

import transformers as tf

from shardformer.core.tiny_run import runnable_tiny_config
from shardformer.tools.testing import run_on_ranks


def _wav2vec2_ctc():
    config = runnable_tiny_config(tf.Wav2Vec2ForCTC, tf.Wav2Vec2Config(), tp=2)
    return tf.Wav2Vec2ForCTC(config)


def _ranks() -> tuple[bool, str]:
    from shardformer.tools.verify import verify_on_this_rank

    report = verify_on_this_rank(_wav2vec2_ctc)
    return report.ok, report.format()


def test_wav2vec2_ctc_is_exact_at_tp2():
    for ok, text in run_on_ranks(_ranks, 2):
        assert ok, text
        assert "derived" in text, text
