"""A benchmark's scratch folder (models, corpora, checkpoints: 14 MB to GBs a run), removed when its process exits."""

from __future__ import annotations

import atexit
import shutil
import tempfile


def scratch_folder(prefix: str) -> str:
    """A new folder under the temp dir, removed at exit (also after an error or Ctrl-C)."""
    folder = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder
