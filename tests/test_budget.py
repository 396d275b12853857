"""RoPE concentration (cross-head PCA) and KV-budget conversion on tiny random models."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import tiny_source

from mha2mla.convert import convert_model, max_latent

TOL = 1e-4


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2[1]


def ids_for(seed=1):
    return torch.randint(3, 49152, (2, 24), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family,n_kv", [("llama", 2), ("llama", 4), ("qwen2", 2)])
def test_pca_rotation_nothing_dropped_is_exact(family, n_kv, tokenizer, wiki_dir):
    src = tiny_source(family, vocab=49152, n_kv=n_kv)
    pairs = n_kv * src.config.head_dim // 2  # every component keeps RoPE
    latent = max_latent(src.config, pairs, "pca")
    mla, _ = convert_model((src, tokenizer), d_kv=latent // n_kv, rope_pairs=pairs, rope_strategy="pca",
                           freq_fold=1, calib_data=[wiki_dir], calib_samples=4, calib_seq_len=32, progress=False)
    assert mla.config.rope_layout == "shared" and mla.config.n_rope_heads == 1
    ids = ids_for()
    assert (mla(ids).logits - src(ids).logits).abs().max().item() <= TOL


def test_pca_cached_decoding_matches_full_forward(tokenizer, wiki_dir):
    src = tiny_source("llama", vocab=49152, n_kv=2)
    mla, _ = convert_model((src, tokenizer), d_kv=8, rope_pairs=4, rope_strategy="pca", freq_fold=2,
                           calib_data=[wiki_dir], calib_samples=4, calib_seq_len=32, progress=False)
    ids = ids_for()
    full = mla(ids).logits
    out = mla(ids[:, :16], use_cache=True)
    cache, steps = out.cache if hasattr(out, "cache") else out.past_key_values, [out.logits]
    for t in range(16, 24):
        steps.append(mla(ids[:, t:t + 1], **{"cache" if hasattr(out, "cache") else "past_key_values": cache},
                         use_cache=True).logits)
    assert (torch.cat(steps, 1) - full).abs().max().item() <= TOL
    assert cache.numel() == 2 * 2 * 24 * (2 * 8 + 2 * 4)  # layers × batch × tokens × (latent + shared RoPE)


@pytest.mark.parametrize("strategy,budget", [("pca", 40), ("pca", 27), ("2-norm", 40)])
def test_budget_is_met_exactly(strategy, budget, tokenizer, wiki_dir):
    src = tiny_source("llama", vocab=49152, n_kv=2)
    mla, _ = convert_model((src, tokenizer), kv_budget=budget, rope_strategy=strategy, calib_data=[wiki_dir],
                           calib_samples=4, calib_seq_len=32, progress=False)
    assert mla.config.kv_elements_per_token_per_layer == budget
    tried = mla.config.conversion["budget_candidates"]
    assert len(tried) >= 2 and all(t["held_in_loss"] > 0 for t in tried)
    best = min(tried, key=lambda t: t["held_in_loss"])
    assert (best["rope_pairs"], best["latent_dim"]) == (mla.config.rope_pairs, mla.config.latent_dim)
    out = mla(ids_for()).logits
    assert torch.isfinite(out).all()


def test_kv_budget_cli_and_errors(smollm2, wiki_dir, tmp_path):
    src_dir = tmp_path / "src"
    tiny_source("llama", vocab=49152, n_kv=2).save_pretrained(src_dir)
    smollm2[1].save_pretrained(src_dir)
    out = tmp_path / "mla"
    common = ["--calib-data", str(wiki_dir), "--calib-samples", "2", "--calib-seq-len", "32"]
    run = subprocess.run([sys.executable, "-m", "mha2mla.cli", "convert", str(src_dir), str(out), "--kv-budget", "30",
                          "--rope-strategy", "pca", *common, "--json"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    kv = subprocess.run([sys.executable, "-m", "mha2mla.cli", "kv-size", str(out), "--json"], capture_output=True,
                        text=True)
    assert json.loads(kv.stdout.strip().splitlines()[-1])["kv_elements_per_token_per_layer"] == 30
    for budget in ("2", "64", "1000"):  # below the smallest possible; the source's own size; above it
        bad = tmp_path / f"bad{budget}"
        run = subprocess.run([sys.executable, "-m", "mha2mla.cli", "convert", str(src_dir), str(bad), "--kv-budget",
                              budget, "--rope-strategy", "pca", *common], capture_output=True, text=True)
        assert run.returncode == 2 and "Traceback" not in run.stderr
        assert [line for line in run.stderr.splitlines() if line.startswith("error: ")][0].count("--kv-budget")
        assert not bad.exists()


def test_kv_balance_auto_is_chosen_on_held_in_text(tokenizer, wiki_dir):
    src = tiny_source("llama", vocab=49152, n_kv=2)
    mla, _ = convert_model((src, tokenizer), d_kv=4, rope_pairs=2, rope_strategy="2-norm", kv_balance="auto",
                           calib_data=[wiki_dir], calib_samples=4, calib_seq_len=32, progress=False)
    tried = mla.config.conversion["budget_candidates"]
    assert sorted(t["kv_balance"] for t in tried) == [0.25, 1.0, 4.0]
    best = min(tried, key=lambda t: t["held_in_loss"])
    assert mla.config.conversion["kv_balance"] == best["kv_balance"]
    losses = {t["kv_balance"]: t["held_in_loss"] for t in tried}
    assert len(set(losses.values())) == 3  # the balance really changes the factorisation
