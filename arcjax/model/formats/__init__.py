"""Checkpoint formats, apart from the architectures: `loader.load_model` picks the format
of a resolved `hub.ModelSource` and reads it into params.

  hub.py                   local path / GGUF file / Hub id -> ModelSource
  loader.py                any source -> (config, params on the devices)
  hf_checkpoint.py         Hugging Face directories: config.json, safetensors, orbax cache
  quantized_checkpoint.py  FP8/INT8 checkpoints (compressed-tensors, Hub FP8), KV scales
  gguf_file.py             GGUF metadata and tensors; gguf_config.py its config;
                           gguf_tokenizer.py its tokenizer and chat template
"""
