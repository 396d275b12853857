"""LatentCache: the KV cache of an MLA model, holding only what MLA needs to attend.

Per layer it stores two tensors and nothing else:

    c_kv    [batch, 1, tokens, n_kv·d_kv]        the joint latent (shared by every query head)
    k_rope  [batch, n_rope_heads, tokens, 2r]    the RoPE'd key part

so a token costs latent_dim + n_rope_heads·2r values per layer (both may differ between layers),
against 2·n_kv·d_h for an MHA/GQA cache. Full keys and values are never stored; the attention
rebuilds them transiently or, when decoding, never (weight absorption in modeling_mla).

Unquantized, each tensor lives in a buffer with up to GROW_TOKENS spare token rows: a decode step
writes one row instead of copying the whole layer cache (what torch.cat in DynamicLayer does, O(T)
per step); the buffer is reallocated only when full. `keys`/`values` are views of the filled rows.

With `kv_bits` 4 or 2 the cache quantizes both tensors per token, in groups of `group_size` values,
asymmetrically (x ≈ scale·q + zero, q ∈ [0, 2^bits − 1]) and packs 8/bits codes per byte; the newest
`residual` tokens stay in full precision (the KIVI recipe), so the freshest context, which attention
weights most, is exact. Bytes per token and layer then are, for each of the two tensors of width D:
D·bits/8 (codes) + 2·(D/g)·2 (fp16 scale and zero per group of g values).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .configuration_mla import group_size_for


# Spare token rows a full buffer grows by: one O(T) reallocation per GROW_TOKENS decode steps, and
# at most GROW_TOKENS·(n_kv·d_kv + n_rope·2r) unused values per layer.
GROW_TOKENS = 256


def append_rows(buffer: torch.Tensor, length: int, x: torch.Tensor) -> torch.Tensor:
    """`buffer` with `x` written after its first `length` rows (dim −2), reallocated when full."""
    needed = length + x.shape[-2]
    if needed > buffer.shape[-2]:
        grown = x.new_empty(*x.shape[:-2], needed + GROW_TOKENS, x.shape[-1])
        grown[..., :length, :] = buffer[..., :length, :]
        buffer = grown
    buffer[..., length:needed, :] = x
    return buffer


def quantize(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-wise asymmetric quantization of the last dim, packed: (codes uint8, scale, zero) in fp16.

    Codes are packed in planes: byte j holds values j, j + n, j + 2n … (n = width·bits/8), one per
    `bits`-wide field, so unpacking is one shift-and-mask per plane over contiguous bytes."""
    *lead, width = x.shape
    xg = x.float().reshape(*lead, width // group, group)
    lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
    levels = 2**bits - 1
    scale = ((hi - lo) / levels).clamp_min(1e-8)
    q = ((xg - lo) / scale).round_().clamp_(0, levels).to(torch.uint8).reshape(*lead, width)
    per_byte = 8 // bits
    planes = q.reshape(*lead, per_byte, width // per_byte)
    packed = planes[..., 0, :].clone()
    for k in range(1, per_byte):
        packed |= planes[..., k, :] << (bits * k)
    return packed, scale.squeeze(-1).half(), lo.squeeze(-1).half()


def dequantize(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
               dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of `quantize`, in `dtype`, written into `out` ([*lead, width]) when given."""
    *lead, n_bytes = packed.shape
    per_byte, groups = 8 // bits, scale.shape[-1]
    if out is None:
        out = packed.new_empty(*lead, n_bytes * per_byte, dtype=dtype)
    for k in range(per_byte):     # codes straight into the output, converted on the way
        out[..., k * n_bytes:(k + 1) * n_bytes] = (packed >> (bits * k)) & (2**bits - 1)
    grouped = out.view(*lead, groups, n_bytes * per_byte // groups)
    grouped.mul_(scale.to(dtype).unsqueeze(-1)).add_(zero.to(dtype).unsqueeze(-1))
    return out


class BatchOpsMixin:
    """Beam search and batch edits of a layer, through its `_map(fn)` over every stored tensor."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices, ...])


class LatentLayer(BatchOpsMixin, DynamicLayer):
    """One layer's unquantized cache: `keys` = c_kv and `values` = k_rope (the inherited names), each a
    view of the filled rows of a buffer with spare rows (`buffers`)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.buffers = tuple(x[..., :0, :] for x in (key_states, value_states))
        self.keys, self.values = self.buffers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length, new = self.keys.shape[-2], key_states.shape[-2]
        self.buffers = tuple(append_rows(b, length, x) for b, x in zip(self.buffers, (key_states, value_states)))
        self.keys, self.values = (b[..., :length + new, :] for b in self.buffers)
        return self.keys, self.values

    def _map(self, fn) -> None:
        if self.is_initialized:
            self.keys, self.values = fn(self.keys), fn(self.values)
            self.buffers = (self.keys, self.values)

    def reset(self) -> None:
        self.buffers = None
        super().reset()


class QuantizedLatentLayer(BatchOpsMixin, DynamicLayer):
    """One layer's latent cache with int4/int2 storage and a full-precision window of recent tokens.

    `keys` / `values` (inherited names) hold the full-precision window of c_kv / k_rope; `packed`
    holds, per tensor, buffers (codes, scale, zero) with spare token rows, of which the first
    `quantized` rows are filled: a decode step quantizes the token leaving the window and writes its
    row, without copying the history. Attention reads the history dequantized into one transient
    tensor per layer, which holds no more than one layer's full-precision cache at a time.
    """

    is_croppable = False

    def __init__(self, bits: int, residual: int, group_size: int):
        super().__init__()
        if bits not in (2, 4):
            raise ValueError(f"kv_bits must be 16, 4 or 2, got {bits}")
        self.bits, self.residual, self.group_size = bits, residual, group_size
        self.packed: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
        self.quantized = 0
        self.dtype: torch.dtype | None = None

    def _quantize(self, x: torch.Tensor):
        width = x.shape[-1]
        if (width * self.bits) % 8:
            raise ValueError(f"a cached width of {width} cannot be packed at {self.bits} bits")
        return quantize(x, self.bits, group_size_for(width, self.group_size))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.dtype = key_states.dtype
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        overflow = self.keys.shape[-2] - self.residual
        if overflow > 0:
            fresh = [self._quantize(t[..., :overflow, :]) for t in (self.keys, self.values)]
            if self.packed is None:
                self.packed = [tuple(t[..., :0, :] for t in parts) for parts in fresh]
            self.packed = [tuple(append_rows(b, self.quantized, x) for b, x in zip(old, new))
                           for old, new in zip(self.packed, fresh)]
            self.quantized += overflow
            self.keys = self.keys[..., overflow:, :].contiguous()
            self.values = self.values[..., overflow:, :].contiguous()
        return self._full()

    def _stored_packed(self) -> list[tuple[torch.Tensor, ...]]:
        """The filled rows of the packed buffers."""
        return [tuple(t[..., :self.quantized, :] for t in parts) for parts in self.packed or []]

    def _full(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(c_kv, k_rope) over every cached token: the history dequantized, then the window."""
        if self.packed is None:
            return self.keys, self.values
        full = []
        for parts, window in zip(self._stored_packed(), (self.keys, self.values)):
            out = window.new_empty(*window.shape[:-2], self.quantized + window.shape[-2], window.shape[-1])
            dequantize(*parts, self.bits, self.dtype, out=out[..., :self.quantized, :])
            out[..., self.quantized:, :] = window
            full.append(out)
        return full[0], full[1]

    def get_seq_length(self) -> int:
        return self.quantized + self.keys.shape[-2] if self.is_initialized else 0

    def tensors(self) -> list[torch.Tensor]:
        stored = [self.keys, self.values] if self.is_initialized else []
        return stored + [t for parts in self._stored_packed() for t in parts]

    def _map(self, fn) -> None:
        if self.is_initialized:
            self.keys, self.values = fn(self.keys), fn(self.values)
            if self.packed is not None:
                self.packed = [tuple(fn(t) for t in parts) for parts in self._stored_packed()]

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a quantized latent cache cannot be cropped; use kv_bits=16")

    def reset(self) -> None:
        self.packed, self.quantized = None, 0
        super().reset()


class LatentCache(Cache):
    """A transformers Cache of c_kv and k_rope per layer, optionally int4/int2-quantized.

    `model.generate()` on an MLA model creates one automatically (with `config.kv_bits`); pass
    `cache=LatentCache(model.config, kv_bits=4)` (or `past_key_values=` on older transformers) to
    choose per call.
    """

    def __init__(self, config, kv_bits: int | None = None, residual: int | None = None,
                 group_size: int | None = None):
        self.kv_bits = int(kv_bits if kv_bits is not None else getattr(config, "kv_bits", 16))
        residual = config.kv_residual if residual is None else residual
        group_size = config.kv_group_size if group_size is None else group_size
        if self.kv_bits == 16:
            layers = [LatentLayer() for _ in range(config.num_hidden_layers)]
        else:
            layers = [QuantizedLatentLayer(self.kv_bits, residual, group_size)
                      for _ in range(config.num_hidden_layers)]
        super().__init__(layers=layers)

    def stored_tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache holds, cut to the stored tokens (unquantized layers keep up to
        GROW_TOKENS spare token rows beyond these in their buffers)."""
        out = []
        for layer in self.layers:
            if isinstance(layer, QuantizedLatentLayer):
                out += layer.tensors()
            elif layer.is_initialized:
                out += [layer.keys, layer.values]
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.stored_tensors())

    def numel(self) -> int:
        return sum(t.numel() for t in self.stored_tensors())
