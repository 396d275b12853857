"""RoPE concentration (cross-head PCA) and KV-budget conversion on tiny random models."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import ids_for, tiny_source

from mha2mla.conversion.plan import budget_splits
from mha2mla import convert as convert_model
from mha2mla.conversion.stages.rope.layout import layout_for
from mha2mla.conversion.stages.rope.pca import pca_basis

TOL = 1e-4


def decode_steps(mla, ids, prefill: int):
    """Logits of a prefill of `prefill` tokens then one cached step per token, and the cache."""
    out = mla(ids[:, :prefill], use_cache=True)
    name = "cache" if hasattr(out, "cache") else "past_key_values"
    cache, steps = getattr(out, name), [out.logits]
    for t in range(prefill, ids.shape[1]):
        steps.append(mla(ids[:, t:t + 1], **{name: cache}, use_cache=True).logits)
    return torch.cat(steps, 1), cache


@pytest.mark.parametrize("family,n_kv", [("llama", 2), ("llama", 4), ("qwen2", 2)])
def test_pca_rotation_nothing_dropped_is_exact(family, n_kv, tokenizer, calib_text):
    src = tiny_source(family, n_kv=n_kv)
    pairs = n_kv * src.config.head_dim // 2  # every component keeps RoPE
    latent = layout_for("pca", src.config).max_latent(pairs)
    mla, _ = convert_model((src, tokenizer), d_kv=latent // n_kv, rope_pairs=pairs, rope="pca",
                           freq_fold=1, calib_data=[calib_text], calib_samples=4, calib_seq_len=32, progress=False)
    assert mla.config.rope_layout == "shared" and mla.config.n_rope_heads == 1
    ids = ids_for()
    assert (mla(ids).logits - src(ids).logits).abs().max().item() <= TOL


def test_folded_rope_components_are_spread_over_frequency_groups():
    # one KV head, d_h = 16 (8 frequencies), fold 4 → two groups; the first group holds almost all key
    # energy, yet each group keeps its own top component, rotating with the group's first frequency
    energy = torch.tensor([5.0, 4.0, 3.0, 2.0, 0.01, 0.04, 0.02, 0.03], dtype=torch.float64)
    e_kk = torch.diag(torch.cat([energy, energy]))  # (re, im) dims of the 8 pairs
    basis = pca_basis(e_kk, torch.eye(16, dtype=torch.float64), n_heads=1, n_kv=1, head_dim=16, n_pairs=2,
                      fold=4, inv_freq=[0.5**k for k in range(8)], max_distance=64)
    assert basis.freq_index == [0, 4]
    assert basis.r_re[0, 0].abs().item() == pytest.approx(1.0)  # group 1's top: pair 0
    assert basis.r_re[1, 5].abs().item() == pytest.approx(1.0)  # group 2's top: pair 5
    more = pca_basis(e_kk, torch.eye(16, dtype=torch.float64), n_heads=1, n_kv=1, head_dim=16, n_pairs=4,
                     fold=4, inv_freq=[0.5**k for k in range(8)], max_distance=64)
    assert sorted(more.freq_index) == [0, 2, 4, 6]  # two per group: ranks 0 and 1 at frequencies 0 and 2 of it


def test_pca_cached_decoding_matches_full_forward(tokenizer, calib_text):
    src = tiny_source("llama", n_kv=2)
    mla, _ = convert_model((src, tokenizer), d_kv=8, rope_pairs=4, rope="pca", freq_fold=2,
                           calib_data=[calib_text], calib_samples=4, calib_seq_len=32, progress=False)
    ids = ids_for()
    stepped, cache = decode_steps(mla, ids, 16)
    assert (stepped - mla(ids).logits).abs().max().item() <= TOL
    assert cache.numel() == 2 * 2 * 24 * (2 * 8 + 2 * 4)  # layers × batch × tokens × (latent + shared RoPE)


@pytest.mark.parametrize("strategy,budget", [("pca", 40), ("pca", 27), ("2-norm", 40)])
def test_budget_is_met_exactly(strategy, budget, tokenizer, calib_text):
    src = tiny_source("llama", n_kv=2)
    mla, _ = convert_model((src, tokenizer), kv_budget=budget, rope=strategy, calib_data=[calib_text],
                           calib_samples=4, calib_seq_len=32, progress=False)
    assert mla.config.kv_elements_per_token_per_layer == budget
    tried = mla.config.conversion["budget_candidates"]
    assert len(tried) >= 2 and all(t["held_out_loss"] > 0 for t in tried)
    best = min(tried, key=lambda t: t["held_out_loss"])
    assert (best["rope_pairs"], best["latent_dim"]) == (mla.config.rope_pairs, mla.config.latent_dim)
    ids = ids_for()
    stepped, cache = decode_steps(mla, ids, 16)   # the cache holds exactly the budget per token and layer
    assert (stepped - mla(ids).logits).abs().max().item() <= TOL
    assert cache.numel() == mla.config.num_hidden_layers * 2 * 24 * budget


def test_kv_balance_auto_is_chosen_on_held_out_text(tokenizer, calib_text):
    src = tiny_source("llama", n_kv=2)
    mla, _ = convert_model((src, tokenizer), d_kv=4, rope_pairs=2, rope="2-norm", kv_balance="auto",
                           calib_data=[calib_text], calib_samples=4, calib_seq_len=32, progress=False)
    tried = mla.config.conversion["budget_candidates"]
    assert sorted(t["kv_balance"] for t in tried) == [0.25, 1.0, 4.0]
    best = min(tried, key=lambda t: t["held_out_loss"])
    assert mla.config.conversion["kv_balance"] == best["kv_balance"]
    losses = {t["kv_balance"]: t["held_out_loss"] for t in tried}
    assert len(set(losses.values())) == 3  # the balance really changes the factorisation


@pytest.mark.parametrize("layout", ["shared", "per_head"])
def test_layers_with_their_own_split_decode_exactly(layout):
    from mha2mla.modeling import MLAConfig, MLAForCausalLM

    torch.manual_seed(0)
    cfg = MLAConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, rope_layout=layout, layer_rope_pairs=[1, 3, 2],
                    layer_latent_dims=[10, 6, 8], initializer_range=0.1)
    mla = MLAForCausalLM(cfg).eval()
    widths = [attn.kv_down.out_features for attn in (layer.self_attn for layer in mla.model.layers)]
    assert widths == [10, 6, 8]
    assert [layer.self_attn.d_nope for layer in mla.model.layers] == ([16] * 3 if layout == "shared" else [14, 10, 12])
    ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        stepped, cache = decode_steps(mla, ids, 12)
        assert (stepped - mla(ids).logits).abs().max().item() <= TOL
    n_rope = cfg.n_rope_heads
    per_token = sum(cfg.layer_latent_dims[i] + n_rope * 2 * cfg.layer_rope_pairs[i] for i in range(3))
    assert cache.numel() == 2 * 20 * per_token
    assert cfg.kv_elements_per_token_per_layer == per_token / 3


@pytest.mark.parametrize("strategy", ["pca", "2-norm"])
def test_per_layer_split_meets_the_budget_in_every_layer(strategy, tokenizer, calib_text, tmp_path):
    from mha2mla.conversion.plan import budget_splits
    from mha2mla.evaluate.kv_memory import kv_size_of

    src = tiny_source("llama", n_kv=2, layers=3)
    budget = 40
    mla, _ = convert_model((src, tokenizer), tmp_path / "mla", kv_budget=budget, rope=strategy,
                           allocate="per-layer", calib_data=[calib_text], calib_samples=4, calib_seq_len=32,
                           progress=False)
    c = mla.config
    options = budget_splits(src.config, budget, layout_for(strategy, src.config, fold=4))
    assert len(options) >= 2 and len(c.layer_rope_pairs) == len(c.layer_latent_dims) == 3
    assert all(split in options for split in zip(c.layer_rope_pairs, c.layer_latent_dims))
    assert [c.kv_elements_at(i) for i in range(3)] == [budget] * 3
    assert kv_size_of(tmp_path / "mla")["kv_elements_per_token_per_layer"] == budget
    ids = ids_for()
    # the checkpoint's own modeling code, the class its auto_map names (what AutoModelForCausalLM with
    # trust_remote_code loads where the package is not imported), reads the per-layer split
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    auto_map = json.loads((tmp_path / "mla" / "config.json").read_text())["auto_map"]
    own_class = get_class_from_dynamic_module(auto_map["AutoModelForCausalLM"], str(tmp_path / "mla"))
    loaded = own_class.from_pretrained(tmp_path / "mla").eval()
    assert not type(loaded).__module__.startswith("mha2mla") and type(loaded).__module__.endswith("modeling_mla")
    assert not type(loaded.config).__module__.startswith("mha2mla")
    with torch.no_grad():
        assert (loaded(ids).logits - mla(ids).logits).abs().max().item() == 0.0


def test_per_layer_split_needs_a_budget(tokenizer, calib_text):
    from mha2mla.errors import UserError

    with pytest.raises(UserError, match="--kv-budget"):
        convert_model((tiny_source("llama"), tokenizer), d_kv=4, allocate="per-layer",
                      calib_data=[calib_text], calib_samples=2, calib_seq_len=32, progress=False)


def test_held_out_blocks_are_the_next_documents(tokenizer, tmp_path):
    from mha2mla.io.text import calibration_blocks

    docs = [f"Document {i}. " + " ".join(f"word{i}x{j}" for j in range(60)) for i in range(8)]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    calib, held_out = calibration_blocks(tokenizer, [path], 32, n_calib=2, n_held_out=3)
    tokens = [tokenizer(d, add_special_tokens=False)["input_ids"] for d in docs]
    assert len(tokens[0]) > 64  # both calibration blocks come from document 0 …
    assert calib.tolist() == [tokens[0][:32], tokens[0][32:64]]
    assert held_out.tolist() == [t[:32] for t in tokens[1:4]]  # … the held-out blocks from documents 1-3


def test_budget_search_without_enough_held_out_documents_is_a_user_error(tokenizer, tmp_path):
    from mha2mla.errors import UserError

    path = tmp_path / "one.txt"
    path.write_text(" ".join(f"word{j}" for j in range(400)))  # one document: nothing left for held-out text
    with pytest.raises(UserError, match="more documents"):
        convert_model((tiny_source("llama"), tokenizer), kv_budget=40, rope="pca",
                      calib_data=[path], calib_samples=2, calib_seq_len=32, progress=False)


def test_d_kv_names_the_cache_in_the_papers_terms():
    """SmolLM2's shape: the per-head layout at d_kv=16 (r=4) and the shared key with 16 RoPE dims cache
    72 values each, and both are called d_kv=16."""
    from mha2mla.modeling import MLAConfig

    smol = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=2)
    shared = MLAConfig(**smol, rope_layout="shared", d_kv=16, rope_pairs=8)
    per_head = MLAConfig(**smol, rope_layout="per_head", d_kv=16, rope_pairs=4)
    assert (shared.latent_dim, per_head.latent_dim) == (56, 48)
    assert shared.kv_elements_per_token_per_layer == per_head.kv_elements_per_token_per_layer == 72
    assert shared.paper_d_kv() == per_head.paper_d_kv() == shared.d_kv == per_head.d_kv == 16
    uneven = MLAConfig(**smol, rope_layout="shared", rope_pairs=8, layer_rope_pairs=[8, 4], layer_latent_dims=[56, 66])
    assert uneven.paper_d_kv() == pytest.approx((72 + 74) / 2 / 3 - 8, abs=0.01)


def test_allocation_is_the_least_summed_error_at_exactly_the_total():
    from mha2mla.conversion.allocate import allocate, interpolate, width_grid

    assert interpolate({2: 1.0, 4: 0.0, 5: 0.0}) == {2: 1.0, 3: 0.5, 4: 0.0, 5: 0.0}
    assert width_grid(8, cap=12) == [2, 4, 6, 8, 10, 12]        # GRID × 8, the 16 and 24 capped at 12
    rope_values = {1: 2, 2: 4}
    # layer 0 gains a lot from RoPE (r = 2), layer 1 from latent width; r = 1 everywhere is the uniform split
    flat = {(1, 2): 0.5, (1, 6): 0.4, (2, 2): 0.05, (2, 6): 0.05}
    steep = {(1, 2): 0.9, (1, 6): 0.1, (2, 2): 0.9, (2, 6): 0.1}
    assert allocate([flat, steep], rope_values, total=2 * 6) == [(2, 2), (1, 4)]
    # brute force over every interpolated choice agrees, at several totals
    def error(curve, r, w):
        return interpolate({x: e for (s, x), e in curve.items() if s == r})[w]
    for total in range(8, 17):
        options = [(r, w) for r in (1, 2) for w in range(2, 7)]
        feasible = [(error(flat, *a) + error(steep, *b), [a, b]) for a in options for b in options
                    if rope_values[a[0]] + a[1] + rope_values[b[0]] + b[1] == total]
        got = allocate([flat, steep], rope_values, total)
        assert sum(rope_values[r] + w for r, w in got) == total
        assert error(flat, *got[0]) + error(steep, *got[1]) == pytest.approx(min(feasible)[0])
    with pytest.raises(ValueError):
        allocate([flat, steep], rope_values, total=30)


@pytest.mark.parametrize("strategy", ["pca", "2-norm"])
def test_global_allocation_keeps_the_total_and_decodes_exactly(strategy, tokenizer, calib_text, tmp_path):
    from mha2mla.evaluate.kv_memory import kv_size_of

    src = tiny_source("llama", n_kv=2, layers=3)
    budget = 40
    mla, _ = convert_model((src, tokenizer), tmp_path / "mla", kv_budget=budget, rope=strategy,
                           allocate="global", calib_data=[calib_text], calib_samples=4, calib_seq_len=32,
                           progress=False)
    c = mla.config
    per_layer = [c.kv_elements_at(i) for i in range(3)]
    assert sum(per_layer) == 3 * budget and c.conversion["allocate"] == "global"
    assert set(c.layer_rope_pairs) <= {r for r, _ in budget_splits(src.config, budget, layout_for(strategy, src.config))}
    report = kv_size_of(tmp_path / "mla")
    assert report["kv_elements_per_token_per_layer"] == budget
    assert report["per_layer"] == {"min": min(per_layer), "mean": budget, "max": max(per_layer)}
    ids = ids_for()
    with torch.no_grad():
        stepped, cache = decode_steps(mla, ids, 12)
        assert (stepped - mla(ids).logits).abs().max().item() <= TOL
    assert cache.numel() == 2 * 24 * sum(per_layer)


def test_global_allocation_refuses_what_sets_widths_itself(tokenizer, calib_text, tmp_path):
    from mha2mla.errors import UserError

    src = tiny_source("llama", n_kv=2, layers=2)
    with pytest.raises(UserError, match="global allocation sets each layer's latent width"):
        convert_model((src, tokenizer), tmp_path / "mla", kv_budget=40, allocate="global", svd="split",
                      calib_data=[calib_text], calib_samples=4, calib_seq_len=32, progress=False)
    assert not (tmp_path / "mla").exists()
