"""Applications built on the conversion and evaluation: fine-tuning (train.py), the end-to-end demo
(demo.py), text generation (generate.py), the loss-curve figure (plot.py)."""
