"""Weights as a stream: read a checkpoint tensor by tensor, write one shard by shard.

A conversion never needs the whole source in memory: it reads one decoder layer's tensors, converts
them, writes the result and lets them go. The readers give Hugging Face parameter names
(`model.layers.3.self_attn.k_proj.weight`) and tensors in the checkpoint's storage dtype:

    SafetensorsReader  a model directory: model.safetensors, or the shards listed in
                       model.safetensors.index.json, each opened with safe_open (memory-mapped)
    GGUFTensorReader   a .gguf file through gguf's memory-mapped reader; each tensor is dequantized
                       when asked for (float32) and un-permuted as transformers' own GGUF loader does
                       (its name map and tensor processors, e.g. llama.cpp's q/k row order for Llama)
    StateDictReader    a model already in memory

`load_module` fills a copy of one module of a meta-device model skeleton (a decoder layer, the
embeddings) with its tensors from a reader: how the converter holds one source layer at a time.

ShardWriter writes tensors as they come into safetensors shards of at most `max_shard_bytes` each,
named and indexed as `save_pretrained` names them (model.safetensors alone, or
model-0000i-of-0000n.safetensors + model.safetensors.index.json), so `from_pretrained` loads the
result as any other checkpoint. It holds at most one shard's worth of tensors.
"""

from __future__ import annotations

import copy
import json
import mmap
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.quants import _type_traits
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

from ..errors import UserError

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
# Shards are flushed at this size: small enough to bound the writer's memory (save_pretrained's own
# default, 50 GB in transformers 5, would hold a whole 7B model in memory before the first write).
MAX_SHARD_BYTES = 512 * 1024**2
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


class StateDictReader:
    """Tensors of a model in memory."""

    def __init__(self, model):
        self.config = model.config
        self._state = model.state_dict()
        self.dtype = next(iter(self._state.values())).dtype

    def names(self) -> set[str]:
        return set(self._state)

    def get(self, name: str) -> torch.Tensor:
        return self._state[name]


class SafetensorsReader:
    """Tensors of a Hugging Face model directory in safetensors format (one file or indexed shards)."""

    def __init__(self, directory: Path, config):
        self.config = config
        directory = Path(directory)
        if (directory / SAFE_INDEX).is_file():
            weight_map = json.loads((directory / SAFE_INDEX).read_text())["weight_map"]
        elif (directory / SAFE_WEIGHTS).is_file():
            weight_map = None
        else:
            raise UserError(f"no safetensors weights in {directory} (expected {SAFE_WEIGHTS} or {SAFE_INDEX})")
        files = sorted(set(weight_map.values())) if weight_map else [SAFE_WEIGHTS]
        self._directory = directory
        keys, dtypes = {}, Counter()
        for file in files:
            path = directory / file
            if not path.is_file():
                raise UserError(f"shard {file} listed in {SAFE_INDEX} is missing from {directory} "
                                f"(re-download the checkpoint)")
            try:
                with safe_open(str(path), framework="pt") as f:
                    keys[file] = set(f.keys())
                    dtypes.update(f.get_slice(name).get_dtype() for name in keys[file])
            except (SafetensorError, OSError) as e:
                raise UserError(f"cannot read the weights in {path}: not a readable safetensors file "
                                f"({str(e).splitlines()[0][:120]}; truncated? re-download it)") from None
        self._where = weight_map or dict.fromkeys(keys[SAFE_WEIGHTS], SAFE_WEIGHTS)
        for name, file in self._where.items():
            if name not in keys[file]:
                raise UserError(f"{file} lacks {name}, which {SAFE_INDEX} places there (re-download the checkpoint)")
        # the storage dtype, read from the headers: the float type most tensors have
        floats = [(n, d) for d, n in dtypes.items() if d in SAFETENSORS_DTYPES]
        if not floats:
            raise UserError(f"no floating-point weights in {directory} (types {', '.join(sorted(dtypes))})")
        self.dtype = SAFETENSORS_DTYPES[max(floats)[1]]

    def names(self) -> set[str]:
        return set(self._where)

    def get(self, name: str) -> torch.Tensor:
        # opened per tensor: the memory map (and the pages it touched) goes with the file, so the
        # process's resident memory does not grow towards the checkpoint's size as layers are read
        with safe_open(str(self._directory / self._where[name]), framework="pt") as f:
            return f.get_tensor(name)


class GGUFTensorReader:
    """Tensors of a .gguf file, dequantized one at a time to float32 under their Hugging Face names."""

    dtype = torch.float32

    def __init__(self, reader, config):
        """`reader`: the file's gguf.GGUFReader (open_gguf)."""
        self.config = config
        self._reader = reader
        arch = gguf_architecture(self._reader)
        self._processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        self._names = get_gguf_hf_weights_map(skeleton, self._processor)  # GGUF name → HF name
        self._tensors = {self._names[t.name]: t for t in self._reader.tensors if t.name in self._names}

    def names(self) -> set[str]:
        return set(self._tensors)

    def get(self, name: str) -> torch.Tensor:
        tensor = self._tensors[name]
        weights = gguf.dequantize(tensor.data, tensor.tensor_type)
        weights = self._processor.process(weights=weights, name=tensor.name, tensor_key_mapping=self._names,
                                          parsed_parameters={}).weights
        result = torch.from_numpy(np.array(weights, dtype=np.float32))
        self._release_pages()
        return result

    def _release_pages(self) -> None:
        """Drop the file pages the read touched from this process (they are re-read from the file if
        needed), so resident memory does not grow towards the file's size as layers are read."""
        mapping = getattr(self._reader.data, "_mmap", None)  # numpy.memmap's mmap.mmap
        if mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
            mapping.madvise(mmap.MADV_DONTNEED)


# the tensor types gguf.dequantize handles (gguf lists them only privately): its quantization classes and
# the plain floats
DEQUANTIZABLE = set(_type_traits) | {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}


def open_gguf(path: Path):
    """gguf's memory-mapped reader; a file that is not (complete) GGUF is a UserError."""
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # bad magic, unknown version, or a header/tensor table cut short
        raise UserError(f"{path} is not a readable GGUF file ({str(e).splitlines()[0][:120] or type(e).__name__}; "
                        f"truncated or not GGUF? re-download it)") from None


def check_gguf_tensors(reader, path: Path) -> None:
    """Every tensor of the GGUF file of a type gguf can dequantize, or a UserError."""
    for t in reader.tensors:
        if t.tensor_type not in DEQUANTIZABLE:
            raise UserError(f"{Path(path).name}: tensor {t.name} has type {t.tensor_type.name}, which cannot be "
                            f"dequantized (supported: F32, F16, BF16, Q4_0 … Q8_0, K-quants, IQ types)")


def gguf_architecture(reader) -> str:
    field = reader.fields.get("general.architecture")
    if field is None:
        raise UserError("the GGUF file names no general.architecture (not a model file?)")
    return bytes(field.parts[field.data[0]]).decode()


class ShardWriter:
    """Write tensors into safetensors shards in `directory`; `close()` names them and writes the index."""

    def __init__(self, directory: Path, max_shard_bytes: int = MAX_SHARD_BYTES):
        self.directory = Path(directory)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []
        self._total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self.flush()
        self._pending[name] = tensor.detach().to("cpu").contiguous()
        self._pending_bytes += size
        self._total += size

    def add_module(self, prefix: str, module: torch.nn.Module, dtype: torch.dtype) -> None:
        for name, tensor in module.state_dict().items():
            self.add(f"{prefix}{name}", tensor.to(dtype))

    def flush(self) -> None:
        if not self._pending:
            return
        path = self.directory / f".shard-{len(self._shards):05d}.safetensors"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._shards.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> None:
        """Flush, rename the shards as save_pretrained names them, write the index (for several)."""
        self.flush()
        n = len(self._shards)
        if n == 1:
            self._shards[0][0].rename(self.directory / SAFE_WEIGHTS)
            return
        weight_map = {}
        for i, (path, names) in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            path.rename(self.directory / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self._total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def load_module(reader, meta_module: torch.nn.Module, prefix: str, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of a module of the meta-device skeleton, on the default device, with its tensors `prefix…`
    read from the checkpoint."""
    module = copy.deepcopy(meta_module).to_empty(device=torch.get_default_device()).to(dtype)
    wanted, present = [prefix + n for n in module.state_dict()], reader.names()
    missing = [n for n in wanted if n not in present]
    if missing:
        raise UserError(f"the source checkpoint lacks {missing[0]} (incomplete or not a {reader.config.model_type} "
                        f"checkpoint)")
    module.load_state_dict({n.removeprefix(prefix): reader.get(n) for n in wanted})
    return module.eval()
