"""The conversion's stages, each a module of small functions on one layer: calibration statistics, the RoPE
layout (rope/), the low-rank factorisation, the output refit, the latent norm, the GQA→MHA expansion."""
