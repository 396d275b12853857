"""RoPE layouts: which part of the keys keeps its rotary embedding — the first stage of a conversion.

A layout is one small interface (RopeLayout) with two implementations:

    PerHeadRope   the MHA2MLA paper's partial RoPE: every KV head keeps r of its d_h/2 frequency
                  pairs (partial_rope: strategies high, low, uniform, 2-norm); n_kv RoPE keys of 2r
                  dims are cached.
    SharedRope    RoPE concentration (rope_pca, strategy pca): one RoPE key of 2r dims shared by all
                  heads, DeepSeek's k_pe; the position-free key is W_k minus its projection on the
                  kept components.

For one layer a layout `measure`s what it needs in the calibration statistics, `choose`s r pairs,
`fill`s the MLA attention's q_proj and k_rope_proj for that choice, and gives the position-free key
rows (`position_free`: weight, bias and, per KV group, the source dims they come from) that the
low-rank stage factors with W_v. For the budget arithmetic and the config it says how many RoPE
keys it caches (cache width = latent + n_rope_keys·2r), the range of r, the rank left to the latent,
how many pairs a share of a budget buys, and the frequencies its choice rotates with.

The query of head h is [its NoPE dims | its RoPE dims]: the source's d_h − 2r position-free dims
then the kept pairs (per head), or the full source query then R q_h (shared: the rotated query
components that meet the shared key).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from ....errors import UserError
from ....modeling.configuration_mla import head_dim_of
from ....recipes import PER_HEAD_STRATEGIES, ROPE_STRATEGIES, SHARED_STRATEGIES
from ..lowrank import second_moment
from .partial import check_rope_pairs, select_pairs, split_dims
from .pca import pca_basis, query_rows


class PositionFree(NamedTuple):
    """The key rows without RoPE, for the low-rank stage: W [rows, D], bias [rows] or None, and per
    KV group the source head dims they stand for (the output-weighted init reads the queries there)."""
    weight: torch.Tensor
    bias: torch.Tensor | None
    dims: list[list[int]]


class RopeLayout(Protocol):
    name: str           # MLAConfig.rope_layout
    strategy: str       # the Recipe.rope strategy it implements
    n_rope_keys: int    # RoPE keys cached per token

    def check(self, rope_pairs: int) -> None: ...
    def max_latent(self, rope_pairs: int) -> int: ...
    def pairs_for(self, budget: int, share: float) -> int: ...
    def measure(self, src_attn, stats): ...
    def choose(self, measured, rope_pairs: int, inv_freq: list[float], max_distance: int): ...
    def frequencies(self, choice) -> list[list[int]]: ...
    def fill(self, src_attn, dst_attn, choice) -> None: ...
    def position_free(self, src_attn, choice) -> PositionFree: ...


@dataclass(frozen=True)
class Heads:
    """The source attention's head geometry."""
    n_heads: int
    n_kv: int
    head_dim: int
    hidden: int

    @classmethod
    def of(cls, config) -> "Heads":
        return cls(config.num_attention_heads, config.num_key_value_heads, head_dim_of(config), config.hidden_size)


def rows(weight: torch.Tensor, heads: int, dims_per_head: list[list[int]]) -> torch.Tensor:
    """Select, head by head, the given dims (rows) of a [heads·d_h, …] projection."""
    per_head = weight.view(heads, -1, *weight.shape[1:])
    return torch.cat([per_head[h, dims] for h, dims in enumerate(dims_per_head)])


@dataclass(frozen=True)
class PerHeadRope:
    """Partial RoPE: r pairs kept per KV head, chosen by `strategy`; query heads share their group's."""
    shape: Heads
    strategy: str = "2-norm"
    name = "per_head"

    @property
    def n_rope_keys(self) -> int:
        return self.shape.n_kv

    def check(self, rope_pairs: int) -> None:
        check_rope_pairs(rope_pairs, self.shape.head_dim, self.strategy)

    def max_latent(self, rope_pairs: int) -> int:
        """min(rows of [W_k_nope; W_v], hidden)."""
        s = self.shape
        return min(s.n_kv * (s.head_dim - 2 * rope_pairs) + s.n_kv * s.head_dim, s.hidden)

    def pairs_for(self, budget: int, share: float) -> int:
        """Pairs per head for a `share` of a cache budget (values per token per layer)."""
        return min(max(1, round(budget * share / (2 * self.n_rope_keys))), self.shape.head_dim // 2)

    def measure(self, src_attn, stats):
        return stats.q_norm, stats.k_norm

    def choose(self, measured, rope_pairs: int, inv_freq: list[float], max_distance: int) -> list[list[int]]:
        return select_pairs(self.strategy, rope_pairs, self.shape.head_dim, self.shape.n_kv, *measured)

    def frequencies(self, choice: list[list[int]]) -> list[list[int]]:
        return choice

    def fill(self, src, dst, kept: list[list[int]]) -> None:
        """q_proj rows per head reordered to [NoPE dims | kept pairs]; k_rope_proj the kept rows of W_k."""
        n_heads, n_kv, d_h = self.shape.n_heads, self.shape.n_kv, self.shape.head_dim
        groups = n_heads // n_kv
        nope, rope = (list(x) for x in zip(*(split_dims(k, d_h) for k in kept)))
        q_dims = [nope[h // groups] + rope[h // groups] for h in range(n_heads)]
        dst.q_proj.weight.copy_(rows(src.q_proj.weight, n_heads, q_dims))
        dst.k_rope_proj.weight.copy_(rows(src.k_proj.weight, n_kv, rope))
        if src.k_proj.bias is not None:
            dst.q_proj.bias.copy_(rows(src.q_proj.bias, n_heads, q_dims))
            dst.k_rope_proj.bias.copy_(rows(src.k_proj.bias, n_kv, rope))

    def position_free(self, src, kept: list[list[int]]) -> PositionFree:
        """The rows of W_k (and b_k) at each head's dropped pairs."""
        nope = [split_dims(k, self.shape.head_dim)[0] for k in kept]
        b_k = src.k_proj.bias
        return PositionFree(rows(src.k_proj.weight, self.shape.n_kv, nope),
                            None if b_k is None else rows(b_k, self.shape.n_kv, nope), nope)


@dataclass(frozen=True)
class SharedRope:
    """RoPE concentration: one shared RoPE key of 2r dims, F adjacent frequencies folded (`fold`)."""
    shape: Heads
    fold: int = 4
    strategy = "pca"
    name = "shared"
    n_rope_keys = 1

    def check(self, rope_pairs: int) -> None:
        limit = self.shape.n_kv * self.shape.head_dim // 2
        if not 1 <= rope_pairs <= limit:
            raise UserError(f"--rope-pairs {rope_pairs} is out of range for pca: use 1 … {limit}")

    def max_latent(self, rope_pairs: int) -> int:
        s = self.shape
        return min(s.n_kv * s.head_dim - 2 * rope_pairs + s.n_kv * s.head_dim, s.hidden)

    def pairs_for(self, budget: int, share: float) -> int:
        """Components for a `share` of a cache budget, rounded to whole rounds over the frequency
        groups (every group keeps as many as the others; rope_pca) when a round fits in the budget."""
        groups = -(-(self.shape.head_dim // 2) // self.fold)  # ⌈(d_h/2) / F⌉
        pairs = budget * share / 2
        return max(1, round(pairs / groups)) * groups if 2 * groups < budget else max(1, round(pairs))

    def measure(self, src_attn, stats):
        """E[k kᵀ], E[q qᵀ] of the source's pre-RoPE keys and queries on the calibration inputs."""
        return tuple(second_moment(proj.weight, proj.bias, stats.cov, stats.mean)
                     for proj in (src_attn.k_proj, src_attn.q_proj))

    def choose(self, measured, rope_pairs: int, inv_freq: list[float], max_distance: int):
        s = self.shape
        return pca_basis(*measured, s.n_heads, s.n_kv, s.head_dim, rope_pairs, self.fold, inv_freq, max_distance)

    def frequencies(self, basis) -> list[list[int]]:
        return [basis.freq_index]

    def fill(self, src, dst, basis) -> None:
        """q_proj = [q_h | R q_h] per head, k_rope_proj = R W_k (and the biases alike)."""
        n_heads, n_kv, d_h = self.shape.n_heads, self.shape.n_kv, self.shape.head_dim
        groups = n_heads // n_kv
        w_q = src.q_proj.weight.view(n_heads, d_h, -1)
        w_k, b_k = src.k_proj.weight.double(), src.k_proj.bias
        dst.q_proj.weight.copy_(torch.cat([torch.cat([w_q[h].double(), query_rows(basis, w_q[h], h // groups, d_h)])
                                           for h in range(n_heads)]))
        dst.k_rope_proj.weight.copy_(torch.cat([basis.r_re @ w_k, basis.r_im @ w_k]))
        if b_k is not None:
            b_q = src.q_proj.bias.view(n_heads, d_h, 1)
            dst.q_proj.bias.copy_(torch.cat([torch.cat([b_q[h, :, 0].double(),
                                                        query_rows(basis, b_q[h], h // groups, d_h)[:, 0]])
                                             for h in range(n_heads)]))
            dst.k_rope_proj.bias.copy_(torch.cat([basis.r_re @ b_k.double(), basis.r_im @ b_k.double()]))

    def position_free(self, src, basis) -> PositionFree:
        """(I − P) W_k and (I − P) b_k: every key dim, less its part on the kept components."""
        n_kv, d_h = self.shape.n_kv, self.shape.head_dim
        keep_out = torch.eye(n_kv * d_h, dtype=torch.float64) - basis.projection()
        b_k = src.k_proj.bias
        return PositionFree(keep_out @ src.k_proj.weight.double(), None if b_k is None else keep_out @ b_k.double(),
                            [list(range(d_h))] * n_kv)


def layout_for(strategy: str, config, fold: int = 4) -> RopeLayout:
    """The layout that implements the RoPE strategy `strategy` (Recipe.rope) for a source with this config."""
    if strategy in SHARED_STRATEGIES:
        return SharedRope(Heads.of(config), fold)
    if strategy in PER_HEAD_STRATEGIES:
        return PerHeadRope(Heads.of(config), strategy)
    raise UserError(f"unknown rope strategy {strategy}: use one of {', '.join(ROPE_STRATEGIES)}")
