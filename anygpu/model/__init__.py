"""Building the model: construction, initialisation, LoRA, keyed dropout, the MoE router loss."""
