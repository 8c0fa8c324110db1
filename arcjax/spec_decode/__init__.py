"""Speculative decoding's host and device parts, one package (the pure planning of draft
rows stays in `scheduler/spec.py`):

  speculative_config.py  `SpeculativeConfig` (vLLM's keys), `ProposalRow`, the `Proposer` protocol
  ngram_proposer.py      prompt lookup (numpy)
  draft_model.py         a small model's own runner and KV slots, drafting greedily
  speculator.py          the engine's side: drafts before each plan, tokens per verified row
  verification.py        per-position inputs and the acceptance inside the jitted step

Each module sits at the layer of the code it extends (tests/test_import_graph.py).
"""
