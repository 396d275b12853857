"""Exports: an MLA checkpoint written in another library's model format, one module per format
(deepseek_v3: stock transformers `DeepseekV3ForCausalLM`, vLLM, SGLang; gguf: llama.cpp's `deepseek2`
GGUF, mapped from the DeepSeek-V3 export). `mha2mla.export` calls them."""
