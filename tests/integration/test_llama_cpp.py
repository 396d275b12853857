"""Opt-in (`make test-llama-cpp`, marker llama_cpp): SmolLM2-135M converted at 72 values and exported as a
llama.cpp `deepseek2` GGUF runs in llama.cpp through llama-cpp-python, with the MLA model's greedy
continuation and logits. (What CI checks of the GGUF file itself: tests/unit/test_export_gguf.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mha2mla.exports.gguf import export_gguf

# llama.cpp's largest logit difference to the float32 MLA model, relative to the largest logit: F16 weights and
# KV cache (measured on SmolLM2 at 72 values: 1.4e-3)
LLAMA_CPP_GAP = 5e-3


@pytest.fixture(scope="module")
def llama_cpp(request):
    if "llama_cpp" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("opt-in: make test-llama-cpp (pytest -m llama_cpp)")
    return pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (make test-llama-cpp)")


@pytest.fixture(scope="module")
def smollm2_b72_gguf(llama_cpp, tmp_path_factory):
    """SmolLM2-135M converted by the default recipe at 72 values, and its f16 GGUF export."""
    from mha2mla import convert as convert_model

    out = tmp_path_factory.mktemp("llama-cpp")
    model, tokenizer = convert_model("smollm2-135m", out / "mla", kv_budget=72)
    export_gguf(out / "mla", out / "mla.gguf")
    return model.eval(), tokenizer, out / "mla.gguf"


@pytest.mark.llama_cpp
@torch.no_grad()
def test_llama_cpp_runs_the_export_as_the_mla_model(llama_cpp, smollm2_b72_gguf):
    """Token ids in (not text): llama.cpp's logits on a short sequence are the MLA model's within the F16
    weights' and F16 KV cache's rounding, and its greedy continuation is the MLA model's."""
    model, tokenizer, path = smollm2_b72_gguf
    ids = tokenizer("The capital of France is Paris. The capital of Germany is", add_special_tokens=False)["input_ids"]
    llm = llama_cpp.Llama(str(path), n_ctx=128, n_threads=2, logits_all=True, verbose=False)
    llm.eval(ids)
    logits = torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float64))
    want = model(torch.tensor([ids])).logits[0].double()
    assert (logits - want).abs().max() < LLAMA_CPP_GAP * want.abs().max()
    assert (logits.argmax(-1) == want.argmax(-1)).all()
    greedy = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    for token in greedy:
        assert int(np.argmax(llm.scores[llm.n_tokens - 1])) == token
        llm.eval([token])
    llm.close()
