"""ntx engine: GGUF reader, quant formats, reference and CUDA backends, tokenizer, sampler, CLI."""
