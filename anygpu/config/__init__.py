"""Arguments: the dataclasses both engines parse, their range checks, the shipped presets and the batch math."""
