"""RoPE layouts: which part of the keys keeps its rotary embedding (layout.py), by partial RoPE per KV
head (partial.py) or RoPE concentration into one shared key (pca.py)."""
