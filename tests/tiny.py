"""Tiny things made in the test: random source and MLA models, a byte-level BPE tokenizer, generated
text and GGUF files. Nothing here downloads, reads ../shared/data or touches SmolLM2.

The tokenizer is GPT-2 style (byte-level BPE, the kind SmolLM2's is): every text tokenizes and
decodes back exactly; `<|endoftext|>`, `<s>`, `</s>` are ids 0, 1, 2 (the tiny models' pad/bos/eos),
the 256 bytes follow, then merges that make each word of WORDS one token (with or without the space
before it). Its size is TINY_VOCAB, the tiny models' vocabulary.
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

import torch

WORDS = ("the cat sat on a mat and the dog ran to the park while birds sang in tall green trees "
         "near a quiet river under the old stone bridge").split()
SPECIAL_TOKENS = ("<|endoftext|>", "<s>", "</s>")  # ids 0, 1, 2: pad, bos, eos of tiny_source


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 bytes (what byte-level BPE vocabularies and GGUF files store)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in bytes_to_unicode().values():
        vocab[char] = len(vocab)
    ranks: dict[tuple[str, str], int] = {}

    def pieces(text: str) -> list[str]:
        """`text` cut by the merges so far (BPE: the best-ranked adjacent pair first)."""
        parts = list(text)
        while len(parts) > 1:
            pairs = [(ranks.get(pair, len(ranks)), i) for i, pair in enumerate(zip(parts, parts[1:]))]
            rank, i = min(pairs)
            if rank == len(ranks):
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return parts

    space = bytes_to_unicode()[ord(" ")]  # "Ġ": a word after a space is its own token too
    for word in sorted(set(WORDS)):
        for text in (word, space + word):  # new merges join what the earlier ones leave, left to right
            parts = pieces(text)
            while len(parts) > 1:
                ranks[(parts[0], parts[1])] = len(ranks)
                vocab.setdefault(parts[0] + parts[1], len(vocab))
                parts[:2] = [parts[0] + parts[1]]
    return vocab, list(ranks)


VOCAB, MERGES = _vocab_and_merges()
TINY_VOCAB = len(VOCAB)


def tiny_tokenizer():
    """The tiny byte-level BPE tokenizer (a transformers fast tokenizer; adds no special tokens)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(vocab=dict(VOCAB), merges=list(MERGES)))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<|endoftext|>", bos_token="<s>",
                                   eos_token="</s>")


def tiny_source(family: str = "llama", n_heads: int = 4, n_kv: int = 2, head_dim: int = 16, layers: int = 2,
                vocab: int = TINY_VOCAB, seed: int = 0, **extra):
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


def tiny_mla(seed: int = 0, **overrides):
    """A tiny random fp32 MLA model; biases, when present, random too."""
    from mha2mla import MLAConfig, MLAForCausalLM

    torch.manual_seed(seed)
    fields = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, d_kv=8, rope_pairs=2, initializer_range=0.1,
                  pad_token_id=0, max_position_embeddings=256)
    fields.update(overrides)
    model = MLAForCausalLM(MLAConfig(**fields)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
    model.generation_config.pad_token_id = 0
    return model


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    """Random token ids in 1..99 (the vocabulary of tiny_mla)."""
    return torch.randint(1, 100, (batch, length), generator=torch.Generator().manual_seed(seed))


def ids_for(seed=1, batch=2, length=24):
    """Random ids of the tiny vocabulary, specials excluded."""
    return torch.randint(3, TINY_VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def write_text(path: Path, docs: int = 200, seed: int = 0) -> Path:
    """One plain text file (one document to the readers) of `docs` sentences of WORDS."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))) + "."
                              for _ in range(docs)))
    return path


def write_documents(path: Path, docs: int = 64, seed: int = 0) -> Path:
    """A WikiExtractor-style shard (like ../shared/data's Wikipedia): `docs` articles between `<doc>` lines,
    each 150-300 words (over 256 tokens: an export's held-out blocks), WORDS mixed with random printable
    strings (so every printable byte occurs)."""
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits + string.punctuation

    def word() -> str:
        if rng.random() < 0.6:
            return rng.choice(WORDS)
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 7)))

    articles = []
    for i in range(docs):
        body = " ".join(word() for _ in range(rng.randint(150, 300)))
        articles.append(f'<doc id="{i}" title="Article {i}">\nArticle {i}\n\n{body}.\n</doc>\n')
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(articles))
    return path


def add_tokenizer_fields(writer, tokenizer, name: str = "tiny") -> None:
    """The tokenizer as llama.cpp's converter writes a byte-level BPE one (`tokenizer.ggml.*`, gpt2 model)."""
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = tokenizer.get_vocab()
    names = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in names] == list(range(len(names)))
    special = set(tokenizer.all_special_tokens)
    writer.add_name(name)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(names)
    writer.add_token_types([3 if t in special else 1 for t in names])  # 3: control, 1: normal
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in state["model"]["merges"]])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")


def write_llama_gguf(model, path, tokenizer) -> None:
    """`model` (a Llama) as llama.cpp's converter writes it: GGUF names, q/k rows permuted, float32
    tensors, the metadata transformers reads, and `tokenizer` (tiny_tokenizer) in GGUF fields."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_vocab_size(config.vocab_size)
    add_tokenizer_fields(writer, tokenizer, name=f"tiny-{config.model_type}")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)

    def permute(w, heads):  # llama.cpp's rotary layout: interleaved pairs per head
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, suffix = name.rsplit(".", 1)
        w = tensor.float().numpy()
        if ".q_proj." in name:
            w = permute(w, config.num_attention_heads)
        elif ".k_proj." in name:
            w = permute(w, config.num_key_value_heads)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def convert_tiny(tokenizer, calib_text, family="llama", out=None, **kw):
    """A tiny GQA source of `family` converted (default recipe unless `kw` says otherwise) on little text."""
    from mha2mla import convert as convert_model

    src = tiny_source(family, n_kv=2)
    return convert_model((src, tokenizer), out, calib_data=[calib_text], calib_samples=4, calib_seq_len=32,
                         progress=False, **kw)[0]


# --- checks shared by the export tests of every tier ---------------------------------------------------

PROMPT = [1, 17, 342, 311, 36, 248, 5, 77]  # token ids below TINY_VOCAB


@torch.no_grad()
def mla_run(model, new_tokens: int = 8, prompt=PROMPT):
    """(logits [T, V], greedy tokens) of a model in this process (an MLA model, or an export loaded by
    AutoModelForCausalLM: its config names no custom code, so that is the stock class too)."""
    ids = torch.tensor([prompt])
    greedy = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)[0, ids.shape[1]:]
    return model(ids).logits[0], greedy.tolist()


def stock_model(path):
    """The exported DeepSeek-V3 checkpoint loaded by transformers' own class."""
    from transformers import AutoModelForCausalLM, DeepseekV3ForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert type(model) is DeepseekV3ForCausalLM
    return model


def fake_run(folder, panel, variant, steps=10, start=3.0):
    """A finished training run's folder as `mha2mla train` leaves it: run.json and a falling loss log."""
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps({"panel": panel, "variant": variant, "finished": True}))
    (folder / "loss.jsonl").write_text("".join(json.dumps({"step": s, "loss": start - 0.1 * s}) + "\n"
                                               for s in range(1, steps + 1)))
    return folder


# --- training runs ---------------------------------------------------------------------------------------

def save_tiny_model(path: Path, head_dim: int = 32, seed: int = 0) -> Path:
    """A tiny random Llama (GQA, 4 heads / 2 KV heads, 2 layers, tied embeddings) with the tiny tokenizer,
    saved as a HF directory."""
    tokenizer = tiny_tokenizer()
    model = tiny_source(n_heads=4, n_kv=2, head_dim=head_dim, layers=2, vocab=len(tokenizer), seed=seed,
                        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def read_log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "loss.jsonl").read_text().splitlines()]


def small_run(model, out, text_dir, steps, **kw):
    from mha2mla.apps.train import train

    kw = {"seq_len": 32, "batch_size": 2, "lr": 1e-3, "save_every": 3, **kw}
    return train(model, out, [text_dir], steps, **kw)
