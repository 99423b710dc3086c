"""The vendor launchers' logic (standard library only): detect (GPUs), vendor_env (presets), launcher (plan, exec)."""
