"""SmolLM2-135M's real weights through the exports and readers: the DeepSeek-V3 export of its first two
layers matches the MLA model (logits, greedy tokens), and the streaming GGUF reader gives exactly the
tensors of transformers' whole-file GGUF load.

The tiny models' export tests: tests/unit/test_export.py, tests/unit/test_export_gguf.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tiny import mla_run, stock_model
from mha2mla import convert as convert_model
from mha2mla.exports.deepseek_v3 import export_checkpoint
from mha2mla.io.readers import GGUFTensorReader, open_gguf

NEAR_LINEAR = 1e-3
PROMPT = [1, 17, 4242, 911, 36, 2048, 5, 77]  # token ids of SmolLM2's vocabulary


@pytest.fixture(scope="module")
def smollm2_pca(smollm2, wiki_dir):
    """SmolLM2-135M's first 2 layers (its real weights, vocabulary and GQA heads; the whole model takes
    minutes to convert) converted with a shared RoPE key (pca, r = 8, d_kv = 16), little calibration."""
    model, tokenizer = smollm2
    head = copy.deepcopy(model)
    head.model.layers = head.model.layers[:2]
    head.config.num_hidden_layers = 2
    return convert_model((head, tokenizer), d_kv=16, rope_pairs=8, weighting="weight", refit="none",
                         calib_data=[wiki_dir], calib_samples=2, calib_seq_len=64, progress=False)


def test_smollm2_export_matches_the_mla_model(smollm2_pca, wiki_dir, tmp_path):
    model, tokenizer = smollm2_pca
    report = export_checkpoint(smollm2_pca, tmp_path / "ds", calib_data=[wiki_dir], calib_samples=2,
                               calib_seq_len=64)
    assert report["qk_rope_head_dim"] == 16 and report["kv_lora_rank"] == model.config.latent_dim
    assert report["logits_gap"]["top1_agreement"] == 1.0
    logits, greedy = mla_run(stock_model(tmp_path / "ds"), new_tokens=12, prompt=PROMPT)
    want_logits, want_greedy = mla_run(model, new_tokens=12, prompt=PROMPT)
    assert (logits - want_logits).abs().max() < NEAR_LINEAR * want_logits.abs().max()
    assert greedy == want_greedy


def test_gguf_reader_gives_the_tensors_of_transformers_gguf_loader(smollm2):
    """Every tensor read (and dequantized, un-permuted) one at a time equals transformers' whole-file load."""
    from mha2mla.io.sources import bundled_gguf

    model = smollm2[0]
    reader = GGUFTensorReader(open_gguf(bundled_gguf("smollm2-135m")), model.config)
    state = model.state_dict()
    expected = {n for n in state if n != "lm_head.weight"}  # tied to the embeddings: not in the file
    assert reader.names() == expected
    for name in sorted(expected):
        assert torch.equal(reader.get(name), state[name]), name
