"""The two training engines: the native FSDP2 loop (fsdp) and the HF Trainer engine (hf)."""


def preflight_checks(engine: str):
    """The launchers' check of what needs the model's config and the world size, for `engine`: what `preflight`
    runs as its `deeper` (torch is imported only when it runs, under ANYGPU_PREFLIGHT_ONLY=1)."""

    def check(parsed: tuple) -> None:
        from anygpu.engines.trunk import startup

        startup.preflight_checks(parsed, engine)

    return check
