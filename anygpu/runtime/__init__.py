"""The process and its machine: process group, accelerator facts, FSDP2 wrapping, file-system helpers, progress."""
