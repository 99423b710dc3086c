"""The HF Trainer engine: engine (set-up and run), trainer (Trainer glue), strategy (what accelerate runs)."""
