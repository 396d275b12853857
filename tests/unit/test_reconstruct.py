"""Layer-wise reconstruction (conversion/stages/reconstruct.py): it lowers each layer's attention-output
error from the closed form's, leaves an exact conversion exact, and its count is checked."""

from __future__ import annotations

import pytest
import torch

from tiny import convert_tiny
from mha2mla.errors import UserError
from mha2mla.recipes import recipe_of


def test_reconstruction_lowers_every_layers_error(tokenizer, calib_text):
    mla = convert_tiny(tokenizer, calib_text, d_kv=2, reconstruct=40)
    errors = mla.config.conversion["reconstruction"]
    assert len(errors) == mla.config.num_hidden_layers
    for before, after in errors:
        assert 0 < after < 0.9 * before, errors


def test_an_exact_conversion_stays_exact(tokenizer, calib_text):
    """Full rank and every RoPE pair kept: the closed form is the source's attention, at rounding level;
    Adam's normalised steps would move it, so the closed form is kept, bit for bit."""
    plain = convert_tiny(tokenizer, calib_text, recipe="paper", d_kv=16, rope_pairs=8)
    mla = convert_tiny(tokenizer, calib_text, recipe="paper", d_kv=16, rope_pairs=8, reconstruct=10)
    for before, after in mla.config.conversion["reconstruction"]:
        assert before < 1e-10 and after == before
    for (name, x), y in zip(plain.state_dict().items(), mla.state_dict().values()):
        assert torch.equal(x, y), name


def test_without_reconstruction_the_record_says_none(tiny_mla_model):
    assert tiny_mla_model.config.conversion["reconstruction"] is None
    assert tiny_mla_model.config.conversion["reconstruct"] == 0


@pytest.mark.parametrize("steps", [-1, 2.5])
def test_a_bad_step_count_is_a_user_error(steps):
    with pytest.raises(UserError, match="--reconstruct"):
        recipe_of("default", reconstruct=steps)


def test_reconstruction_is_deterministic(tokenizer, calib_text):
    a = convert_tiny(tokenizer, calib_text, d_kv=2, reconstruct=5)
    b = convert_tiny(tokenizer, calib_text, d_kv=2, reconstruct=5)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name


def test_the_search_scores_closed_forms_and_reconstructs_the_kept_one(tokenizer, calib_text):
    """With a budget search, the candidates are scored as without reconstruction (the same losses, the
    same winner), and only the kept candidate is reconstructed."""
    plain = convert_tiny(tokenizer, calib_text, kv_budget=24).config
    mla = convert_tiny(tokenizer, calib_text, kv_budget=24, reconstruct=40)
    record = mla.config.conversion
    assert len(record["budget_candidates"]) > 1
    assert record["budget_candidates"] == plain.conversion["budget_candidates"]
    assert (mla.config.rope_pairs, mla.config.latent_dim) == (plain.rope_pairs, plain.latent_dim)
    errors = record["reconstruction"]
    assert all(after <= before for before, after in errors) and any(after < before for before, after in errors)
