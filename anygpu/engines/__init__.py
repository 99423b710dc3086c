"""The two training engines: the native FSDP2 loop (fsdp) and the HF Trainer engine (hf)."""
