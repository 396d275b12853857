"""The MHA2MLA conversion: plan.py (what to convert, decided first), stream.py (the layer stream),
stages/ (what happens to one layer: calibration, RoPE layout, low rank, refit, latent norm, GQA→MHA
expansion), attention.py (one attention layer at one split), search.py and allocate.py (choosing among
candidates and spreading the cache over layers), pipeline.py (convert, convert_checkpoint)."""
