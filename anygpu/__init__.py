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
    import sys
    import warnings

    if not sys.warnoptions:
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
