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
