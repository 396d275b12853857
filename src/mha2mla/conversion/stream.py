"""The layer stream: a checkpoint read one decoder layer at a time while hidden states move through it.

Conversion, allocation and export walk a model the same way: its modules built on the meta device
(the skeleton), the embeddings read, then each decoder layer read (io/readers), run on the hidden
states of a few token blocks and written as what it became, then let go, so memory holds one layer
and those hidden states, never the model. `LayerStream` holds what every such walk needs: the
reader and skeleton, the dtype of the forward passes, and for blocks of T tokens the positions and
the additive causal mask

    mask[i, j] = 0 for j ≤ i,  the dtype's lowest value for j > i   ([1, 1, T, T]).

Runs on the default device (a `torch.device` context); the reader gives tensors in their storage dtype.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM

from ..io.readers import load_module


def causal_mask(seq: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive causal mask of `seq` tokens, [1, 1, seq, seq]."""
    return torch.full((seq, seq), torch.finfo(dtype).min, dtype=dtype).triu(1)[None, None]


def source_rotary(config) -> torch.nn.Module:
    """A source model's rotary embedding (its own frequencies, scaling included), built from its config."""
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    return type(skeleton.model.rotary_emb)(config=config)


@dataclass
class LayerStream:
    reader: object                  # tensor reader: config, dtype, names(), get(name)
    skeleton: torch.nn.Module       # the whole model on the meta device
    dtype: torch.dtype              # of the forward passes
    position_ids: torch.Tensor      # [1, T]
    causal: torch.Tensor            # [1, 1, T, T]

    @classmethod
    def open(cls, reader, seq: int, dtype: torch.dtype, skeleton: torch.nn.Module | None = None) -> "LayerStream":
        """A stream over `reader`'s checkpoint for blocks of `seq` tokens; the skeleton defaults to the
        Auto class's model for the reader's config."""
        if skeleton is None:
            with torch.device("meta"):
                skeleton = AutoModelForCausalLM.from_config(reader.config)
        return cls(reader, skeleton, dtype, torch.arange(seq)[None], causal_mask(seq, dtype))

    @property
    def n_layers(self) -> int:
        return len(self.skeleton.model.layers)

    def load(self, name: str, dtype: torch.dtype | None = None) -> torch.nn.Module:
        """The module `name` (e.g. "model.layers.3") with its weights, in `dtype` (default: the stream's);
        buffers the checkpoint does not hold (RoPE frequencies) computed by the model's own init."""
        module = load_module(self.reader, self.skeleton.get_submodule(name), f"{name}.", dtype or self.dtype)
        for part in module.modules():
            if part._non_persistent_buffers_set:
                self.skeleton._init_weights(part)
        return module

    def layers(self, desc: str | None = None, progress: bool = False) -> Iterator[tuple[int, torch.nn.Module]]:
        """(index, decoder layer with its weights), one at a time."""
        for idx in tqdm(range(self.n_layers), desc=desc, disable=not progress):
            yield idx, self.load(f"model.layers.{idx}")

    def embed(self, embed: torch.nn.Module, blocks: torch.Tensor, batch: int) -> list[torch.Tensor]:
        """Hidden states of token blocks [N, T], `batch` blocks per tensor, in the stream's dtype. The
        embeddings may stay in their storage dtype (for a bf16 source, half the float32 table): only the
        looked-up rows are cast, exactly."""
        return [embed(blocks[i:i + batch]).to(self.dtype) for i in range(0, len(blocks), batch)]

    def positions(self, batch: int) -> torch.Tensor:
        return self.position_ids.expand(batch, -1)

    def forward(self, layer: torch.nn.Module, hidden: torch.Tensor, **kwargs) -> torch.Tensor:
        """`hidden` [B, T, D] through one decoder layer under the causal mask (`kwargs`: e.g. the source's
        position_embeddings)."""
        out = layer(hidden, attention_mask=self.causal, position_ids=self.positions(hidden.shape[0]), **kwargs)
        return out[0] if isinstance(out, tuple) else out  # older transformers return a tuple

    def source_rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A source model's RoPE tables (cos, sin) at the stream's positions, in its dtype."""
        rotary = type(self.skeleton.model.rotary_emb)(config=self.reader.config)
        return rotary(torch.zeros(1, dtype=self.dtype), self.position_ids)
