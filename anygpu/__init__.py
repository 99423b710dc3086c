"""anygpu: train Hugging Face causal LMs on every GPU, with the same math whatever the hardware."""

import os

__version__ = "0.1.0"


def set_offline_defaults() -> None:
    """Nothing is downloaded at run time unless the user says so (HF_HUB_OFFLINE=0).

    Called by the entry points before transformers/datasets are imported: they read these at import.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", os.environ["HF_HUB_OFFLINE"])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def quiet_library_warnings() -> None:
    """Libraries' FutureWarning/DeprecationWarning speak to their callers' authors, not to users: not shown
    (unless the user asked for warnings with -W or PYTHONWARNINGS)."""
    import logging
    import sys
    import warnings

    if not sys.warnoptions:
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
    # torchao (which transformers imports whenever it is installed) tries every CUDA extension it ships and warns for
    # each one this machine cannot load, and torch warns that torchao registers its enums the old way: every
    # process, nothing the user can act on. The FP8 path needs none of those extensions.
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    # --ep: the gradient norm of the experts (sharded over both dims of their mesh) is reduced one dim after the
    # other, which DTensor calls suboptimal at every step; the order is the same on every rank, and it is one scalar.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
