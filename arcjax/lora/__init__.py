"""LoRA adapters, one package (the pure planning of adapter slots stays in
`scheduler/lora_slots.py`):

  lora_request.py   `LoRARequest` (vLLM's name and fields): which adapter a request runs with
  lora_config.py    `LoRAConfig`: slots, rank, host cache size, the delta's implementation
  peft_adapter.py   PEFT directories (and Hub ids) read and validated into host weights
  adapter_cache.py  the host LRU of loaded adapters (`max_cpu_loras`), pinned while in use
  slot_table.py     the device slots: stacked A/B buffers, which adapter each slot holds
  lora_delta.py     the per-token delta inside the step (ragged_dot, gather, masked)

Each module sits at the layer of the code it extends (tests/test_import_graph.py).
"""
