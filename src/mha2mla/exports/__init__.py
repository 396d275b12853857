"""Exports: an MLA checkpoint written in another library's model format, one module per format
(deepseek_v3: stock transformers `DeepseekV3ForCausalLM`, vLLM, SGLang). `mha2mla.export` calls them."""
