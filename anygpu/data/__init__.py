"""Training data: sources (raw text), tokenizer (load or train a BPE), packing (blocks and batches),
order (the seeded global order). Tokenising and packing run once per corpus × tokenizer × block size."""
