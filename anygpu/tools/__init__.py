"""The `anygpu` command and its tools."""
