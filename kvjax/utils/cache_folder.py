"""kvjax's one cache folder: $KVJAX_CACHE, else $XDG_CACHE_HOME/kvjax, else ~/.cache/kvjax. The
built-in models' files (models/hub.py) and matplotlib's config and font cache (kvjax.utils.plotting)
are kept there."""
from __future__ import annotations

import os


def cache_dir() -> str:
    """kvjax's cache folder: $KVJAX_CACHE, else $XDG_CACHE_HOME/kvjax, else ~/.cache/kvjax."""
    return os.environ.get("KVJAX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "kvjax")
