"""The things the fast tiers stand on (tests/tiny.py): the tiny tokenizer round-trips text, its words are
single tokens, its special ids are the tiny models', and the GGUF copy of it tokenizes exactly as it does."""

from __future__ import annotations

from tiny import SPECIAL_TOKENS, TINY_VOCAB, WORDS, tiny_source, write_llama_gguf


def test_the_tiny_tokenizer_round_trips_text_and_keeps_words_whole(tokenizer):
    assert len(tokenizer) == TINY_VOCAB
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == list(SPECIAL_TOKENS)
    text = "Once upon a time, the café's 42 birds sang\n\tüber <s> alles."
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text and max(ids) < TINY_VOCAB
    assert ids[0] != tokenizer.bos_token_id  # adds no special tokens (as SmolLM2's does not)
    for word in set(WORDS):
        assert len(tokenizer(word)["input_ids"]) == len(tokenizer(" " + word)["input_ids"]) == 1, word


def test_the_gguf_copy_of_the_tokenizer_tokenizes_alike(tokenizer, calib_text, tmp_path):
    from transformers import AutoTokenizer

    write_llama_gguf(tiny_source("llama"), tmp_path / "tiny.gguf", tokenizer)
    loaded = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    assert len(loaded) == TINY_VOCAB
    assert (loaded.bos_token, loaded.eos_token) == (tokenizer.bos_token, tokenizer.eos_token)
    text = calib_text.read_text()[:20000]
    assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
