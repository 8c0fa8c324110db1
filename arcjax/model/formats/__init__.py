"""Checkpoint formats, apart from the architectures: `loader.load_model` picks the format
of a resolved `hub.ModelSource`, asks that format's module for the model, and places it.
Imports point one way: loader -> the format modules -> hf_layout (which imports no format).

  hub.py                   local path / GGUF file / Hub id -> ModelSource
  loader.py                any source -> (config, params on the devices): picks, places
  hf_layout.py             config.json -> ModelConfig; Hugging Face tensor names <-> the
                           params tree (name tables, assemble_host), shared by every format
  hf_checkpoint.py         float safetensors directories onto the devices (sharded reads,
                           orbax cache); save_hf
  quant_config.py          a checkpoint's quantization_config, refused options as typed
                           errors before any weight is read
  quantized_checkpoint.py  quantized checkpoints (FP8/INT8: compressed-tensors, Hub FP8;
                           packed: AWQ, GPTQ, compressed-tensors pack-quantized through
                           packed_layouts.py) and their KV scales, into host params
  gguf_file.py             GGUF metadata and tensors, into host params (quant types kept
                           packed through gguf_packed.py); gguf_config.py its config;
                           gguf_tokenizer.py its tokenizer and chat template
"""
