"""LatentCache inside MLA decoding and `generate`: exactness, what it stores, and its quantized forms.

Tiny random fp32 MLA models (initializer_range 0.1, so attention is far from uniform and a wrong
key or position changes the logits); SmolLM2-135M converted at d_kv=16:
tests/integration/test_smollm2_latent_cache.py.
"""

from __future__ import annotations

import pytest
import torch

from mha2mla import LatentCache, MLAConfig, MLAForCausalLM
from mha2mla.modeling import modeling_mla
from mha2mla.modeling.latent_cache import (
    LatentLayer, QuantizedLatentLayer, dequantize, quantize,
)
from mha2mla.modeling.modeling_mla import CACHE_NAME
from tiny import tiny_mla, tokens

VARIANTS = {
    "mha": dict(num_key_value_heads=4),               # MHA-derived: one KV head per query head
    "gqa": dict(num_key_value_heads=2),               # GQA-derived: two query heads per KV head
    "split_svd": dict(svd="split"),
    "attention_bias": dict(attention_bias=True),
    "shared_rope": dict(rope_layout="shared"),        # one RoPE key for all heads (DeepSeek layout)
}
STEPS = 32
TOL = 1e-4


def forward(model, ids, cache=None, attention_mask=None) -> torch.Tensor:
    """Last-position logits [B, V] of one forward, through `cache` when given."""
    kwargs = {CACHE_NAME: cache, "use_cache": True} if cache is not None else {}
    return model(ids, attention_mask=attention_mask, **kwargs).logits[:, -1]


def left_pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    return ids, mask


def generated(out) -> torch.Tensor:
    return out.sequences if hasattr(out, "sequences") else out


# --- exactness of cached decoding ------------------------------------------------------------------

@torch.no_grad()
@pytest.mark.parametrize("prompt_len", [6, 20], ids=["short_prompt", "long_prompt"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_decoding_matches_full_forward(variant, prompt_len):
    model = tiny_mla(**VARIANTS[variant])
    ids = tokens(2, prompt_len)
    cache = LatentCache(model.config)
    logits = forward(model, ids, cache)
    for _ in range(STEPS):
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
        logits = forward(model, ids[:, -1:], cache)
        assert (logits - forward(model, ids)).abs().max() <= TOL
    assert cache.get_seq_length() == ids.shape[1]


@torch.no_grad()
@pytest.mark.parametrize("variant", ["mha", "gqa"])
def test_left_padded_batch_matches_each_row_alone(variant):
    model = tiny_mla(**VARIANTS[variant])
    rows = [tokens(1, n, seed=n)[0] for n in (20, 13, 6)]
    ids, mask = left_pad(rows)
    cache = LatentCache(model.config)
    logits = forward(model, ids, cache, mask)
    for _ in range(STEPS):
        for i, row in enumerate(rows):
            assert (logits[i] - forward(model, row[None])[0]).abs().max() <= TOL
        nxt = logits.argmax(-1, keepdim=True)
        rows = [torch.cat([row, nxt[i]]) for i, row in enumerate(rows)]
        ids, mask = torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)
        logits = forward(model, nxt, cache, mask)


def padded_causal_mask(padding: torch.Tensor, queries: int) -> torch.Tensor:
    """Boolean [B, 1, T, S] mask (True = attend): causal for the last T of S positions, and padding."""
    S = padding.shape[1]
    causal = torch.arange(S)[None, :] <= torch.arange(S - queries, S)[:, None]
    return causal[None, None] & padding[:, None, None, :].bool()


@torch.no_grad()
@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
@pytest.mark.parametrize("queries", [1, 5])
@pytest.mark.parametrize("variant", VARIANTS)
def test_absorbed_path_equals_expanded_path(variant, queries, mask_kind):
    model = tiny_mla(**VARIANTS[variant])
    attn, cfg = model.model.layers[0].self_attn, model.config
    B, S, H = 2, 24, cfg.num_attention_heads
    g = torch.Generator().manual_seed(3)
    q_nope = torch.randn(B, H, queries, attn.d_nope, generator=g)
    q_rope = torch.randn(B, H, queries, attn.d_rope, generator=g)
    c_kv = torch.randn(B, 1, S, cfg.latent_dim, generator=g)
    k_rope = torch.randn(B, cfg.n_rope_heads, S, attn.d_rope, generator=g)
    padding = torch.ones(B, S, dtype=torch.long)
    padding[1, :7] = 0
    mask = padded_causal_mask(padding, queries)
    if mask_kind == "additive":   # what the eager implementation's masks look like
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    absorbed = attn.absorbed(q_nope, q_rope, c_kv, k_rope, mask)
    expanded = attn.expanded(q_nope, q_rope, c_kv, k_rope, mask)
    assert absorbed.shape == expanded.shape == (B, queries, H, cfg.head_dim)
    assert (absorbed - expanded).abs().max() <= 1e-5


def force_path(monkeypatch, absorbed: bool) -> None:
    monkeypatch.setattr(modeling_mla.MLAAttention, "absorbed_is_cheaper", lambda self, t, s: absorbed)


@torch.no_grad()
@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_forward_same_whether_absorbed_or_expanded(variant, monkeypatch):
    """A chunked prefill and decode steps, every cached forward absorbed, then every one expanded."""
    model = tiny_mla(**VARIANTS[variant])
    ids = tokens(2, 24)
    runs = []
    for absorbed in (True, False):
        force_path(monkeypatch, absorbed)
        cache = LatentCache(model.config)
        runs.append(torch.stack([forward(model, ids[:, :8], cache), forward(model, ids[:, 8:16], cache)]
                                + [forward(model, ids[:, t:t + 1], cache) for t in range(16, 24)]))
    assert (runs[0] - runs[1]).abs().max() <= 1e-5


@torch.no_grad()
@pytest.mark.parametrize("variant", ["gqa", "shared_rope"])
def test_attention_implementations_agree(variant):
    """eager (explicit softmax) and sdpa give the same logits, without and with a cache."""
    ids = tokens(2, 20)
    logits = {}
    for implementation in ("eager", "sdpa"):
        model = tiny_mla(**VARIANTS[variant])
        model.set_attn_implementation(implementation)
        assert model.config._attn_implementation == implementation
        cache = LatentCache(model.config)
        steps = [forward(model, ids[:, :12], cache)] + [forward(model, ids[:, t:t + 1], cache) for t in range(12, 20)]
        logits[implementation] = (model(ids).logits, torch.stack(steps))
    for eager, sdpa in zip(logits["eager"], logits["sdpa"]):
        assert (eager - sdpa).abs().max() <= TOL


def test_cost_rule_absorbs_decoding_and_long_pasts_only():
    """SmolLM2's shape at the default budget (shared RoPE key, 8 RoPE dims, 64-wide latent)."""
    config = MLAConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=1,
                       rope_layout="shared", rope_pairs=4, latent_dim=64)
    attn = modeling_mla.MLAAttention(config, 0)
    assert attn.absorbed_is_cheaper(1, 4096) and attn.absorbed_is_cheaper(512, 4096)
    assert not attn.absorbed_is_cheaper(512, 512)


@torch.no_grad()
def test_chunked_prefill_expands_each_token_at_most_once():
    """Shared RoPE key (the default layout): after a first chunk without a past, every chunk of T ≤ S/G
    queries over S cached tokens (G query heads per KV head) attends over the latent, so K/V are rebuilt
    (rows through k_up) for the first chunk only."""
    model = tiny_mla(**VARIANTS["shared_rope"])
    rows = []
    for layer in model.model.layers:
        layer.self_attn.k_up.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[-2]))
    cache = LatentCache(model.config)
    ids = tokens(1, 160)
    forward(model, ids[:, :64], cache)
    for start in range(64, 160, 16):
        forward(model, ids[:, start:start + 16], cache)
    assert sum(rows) == 64 * model.config.num_hidden_layers


@torch.no_grad()
def test_standard_outputs():
    model = tiny_mla()
    ids = tokens(2, 7)
    out = model(ids, output_hidden_states=True)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    assert torch.equal(out.hidden_states[0], model.model.embed_tokens(ids))
    as_tuple = model(ids, return_dict=False)
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], out.logits)


def test_rope_frequencies_are_a_buffer_rebuilt_on_loading(tmp_path):
    model = tiny_mla(rope_layout="shared")
    assert not any("inv_freq" in name for name in model.state_dict())
    model.save_pretrained(tmp_path)
    loaded = MLAForCausalLM.from_pretrained(tmp_path).eval()
    for a, b in zip(model.model.layers, loaded.model.layers):
        assert torch.equal(a.self_attn.rotary_emb.inv_freq, b.self_attn.rotary_emb.inv_freq)
    ids = tokens(2, 12)
    with torch.no_grad():
        assert (model(ids).logits - loaded(ids).logits).abs().max() <= 1e-6


# --- generate() ------------------------------------------------------------------------------------

@torch.no_grad()
def test_generate_uses_latent_cache_greedy():
    model = tiny_mla()
    ids = tokens(2, 10)
    out = model.generate(ids, max_new_tokens=STEPS, do_sample=False, return_dict_in_generate=True)
    assert isinstance(getattr(out, CACHE_NAME), LatentCache)
    uncached = model.generate(ids, max_new_tokens=STEPS, do_sample=False, use_cache=False)
    assert torch.equal(out.sequences, uncached)


@torch.no_grad()
def test_generate_sampling_with_seed_matches_uncached():
    model = tiny_mla()
    ids = tokens(2, 10)
    runs = []
    for use_cache in (True, False):
        torch.manual_seed(1234)
        runs.append(model.generate(ids, max_new_tokens=STEPS, do_sample=True, top_k=0, top_p=1.0,
                                   use_cache=use_cache))
    assert torch.equal(runs[0], runs[1])


@torch.no_grad()
def test_generate_left_padded_batch_matches_each_row_alone():
    model = tiny_mla()
    rows = [tokens(1, n, seed=n)[0] for n in (14, 9, 4)]
    ids, mask = left_pad(rows)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=STEPS, do_sample=False)
    for i, row in enumerate(rows):
        alone = model.generate(row[None], max_new_tokens=STEPS, do_sample=False)
        assert torch.equal(out[i, ids.shape[1]:], alone[0, len(row):])


@torch.no_grad()
def test_generate_beam_search_matches_uncached():
    model = tiny_mla()
    ids = tokens(2, 10)
    out = model.generate(ids, max_new_tokens=16, num_beams=2, do_sample=False, return_dict_in_generate=True)
    assert isinstance(getattr(out, CACHE_NAME), LatentCache)
    uncached = model.generate(ids, max_new_tokens=16, num_beams=2, do_sample=False, use_cache=False)
    assert torch.equal(out.sequences, uncached)


@torch.no_grad()
def test_generate_honours_kv_bits_from_config_and_from_a_passed_cache():
    model = tiny_mla(kv_residual=4, kv_group_size=4)
    ids = tokens(1, 10)
    model.config.kv_bits = 4
    out = model.generate(ids, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    cache = getattr(out, CACHE_NAME)
    assert cache.kv_bits == 4 and all(isinstance(layer, QuantizedLatentLayer) for layer in cache.layers)
    model.config.kv_bits = 16
    mine = LatentCache(model.config, kv_bits=2)
    out = model.generate(ids, max_new_tokens=8, do_sample=False, return_dict_in_generate=True, **{CACHE_NAME: mine})
    assert getattr(out, CACHE_NAME) is mine and isinstance(mine.layers[0], QuantizedLatentLayer)
    assert mine.layers[0].bits == 2 and mine.get_seq_length() == 17


# --- what the cache stores -------------------------------------------------------------------------

@torch.no_grad()
@pytest.mark.parametrize("variant", ["mha", "gqa"])
def test_cache_stores_only_latent_and_rope_key(variant):
    model = tiny_mla(**VARIANTS[variant])
    cfg = model.config
    B, prompt, new = 3, 11, 21
    out = model.generate(tokens(B, prompt), max_new_tokens=new, do_sample=False, return_dict_in_generate=True)
    cache = getattr(out, CACHE_NAME)
    T = prompt + new - 1                                   # the last token is sampled, never fed
    n_kv, r2, L = cfg.num_key_value_heads, 2 * cfg.rope_pairs, cfg.num_hidden_layers
    stored = cache.stored_tensors()
    assert [tuple(t.shape) for t in stored] == [(B, 1, T, n_kv * cfg.d_kv), (B, n_kv, T, r2)] * L
    assert sum(t.numel() for t in stored) == cache.numel() == L * B * T * n_kv * (r2 + cfg.d_kv)
    assert cache.nbytes() == cache.numel() * 4
    assert all(isinstance(layer, LatentLayer) for layer in cache.layers)


@torch.no_grad()
def test_growing_buffers_stay_exact_across_reallocation(monkeypatch):
    """Appends into spare rows and reallocations (here every 3 tokens) keep every stored token."""
    monkeypatch.setattr("mha2mla.modeling.latent_cache.GROW_TOKENS", 3)
    layer = LatentLayer()
    chunks = [torch.randn(2, 1, n, 5) for n in (4, 1, 1, 1, 1, 6, 1)]
    for chunk in chunks:
        c_kv, k_rope = layer.update(chunk, chunk[:, :, :, :2].expand(2, 3, -1, 2))
    assert torch.equal(c_kv, torch.cat(chunks, dim=2))
    assert torch.equal(k_rope, torch.cat(chunks, dim=2)[..., :2].expand(2, 3, -1, 2))
    layer.crop(-2)
    c_kv, _ = layer.update(chunks[0], chunks[0][..., :2].expand(2, 3, -1, 2))
    assert torch.equal(c_kv, torch.cat([torch.cat(chunks, dim=2)[:, :, :-2], chunks[0]], dim=2))


# --- quantized cache -------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [4, 2])
def test_quantize_round_trip_error_is_half_a_step(bits):
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(0)) * 3
    group = 8
    codes, scale, zero = quantize(x, bits, group)
    assert codes.dtype == torch.uint8 and codes.shape == (3, 5, 32 * bits // 8)
    err = (dequantize(codes, scale, zero, bits, torch.float32) - x).view(3, 5, 4, group).abs().amax(-1)
    xg = x.view(3, 5, 4, group)
    lo, step = xg.amin(-1), (xg.amax(-1) - xg.amin(-1)) / (2**bits - 1)
    fp16 = 2.0**-11                                        # scale and zero are stored in fp16
    assert (err <= step * (0.5 + (2**bits - 1) * fp16) + lo.abs() * fp16 + 1e-6).all()


@torch.no_grad()
@pytest.mark.parametrize("bits", [4, 2])
def test_quantized_cache_bytes_match_formula(bits):
    model = tiny_mla(kv_residual=8, kv_group_size=4)
    cfg = model.config
    B, prompt, new = 2, 30, 10
    cache = LatentCache(cfg, kv_bits=bits)
    ids = tokens(B, prompt)
    logits = forward(model, ids, cache)
    for _ in range(new):
        logits = forward(model, logits.argmax(-1, keepdim=True), cache)
    T, residual = prompt + new, cfg.kv_residual
    latent, r2, n_rope = cfg.latent_dim, 2 * cfg.rope_pairs, cfg.n_rope_heads
    # codes + fp16 scale and zero per group: c_kv in groups of 4 (16 values → 4 groups), k_rope one
    # group of 2r = 4 per RoPE head
    per_token = latent * bits / 8 + (latent // 4) * 2 * 2 + n_rope * (r2 * bits / 8 + 1 * 2 * 2)
    assert cfg.kv_bytes_per_token_per_layer(bits) == per_token
    window = residual * (latent + n_rope * r2) * 4           # fp32 residual window
    expected = cfg.num_hidden_layers * B * ((T - residual) * per_token + window)
    assert cache.nbytes() == expected
    assert cache.get_seq_length() == T


@torch.no_grad()
def test_quantized_decoding_stays_close():
    """Measured (32 steps after a 40-token prompt, residual 8, groups of 4; model seeds 0-2): max
    |Δlogit| / std(logits) 0.11-0.18 at int4 and 0.60-1.00 at int2; top-1 agreement 97-98 % and
    83-89 %. Bounds below leave margin over those."""
    model = tiny_mla(kv_residual=8, kv_group_size=4)
    ids = tokens(2, 40 + STEPS)
    reference = model(ids).logits[:, 40:]
    errors = {}
    for bits in (4, 2):
        cache = LatentCache(model.config, kv_bits=bits)
        forward(model, ids[:, :40], cache)
        logits = torch.stack([forward(model, ids[:, t:t + 1], cache) for t in range(40, 40 + STEPS)], dim=1)
        errors[bits] = ((logits - reference).abs().max() / reference.std(),
                        (logits.argmax(-1) == reference.argmax(-1)).float().mean())
    assert errors[4][0] <= 0.3 and errors[4][1] >= 0.9
    assert errors[2][0] <= 1.5 and errors[2][1] >= 0.7
    assert errors[2][0] > errors[4][0]
