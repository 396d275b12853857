"""Evaluation: perplexity, lm-eval tasks, passkey retrieval, KV-cache memory, decode speed."""
