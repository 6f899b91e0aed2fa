"""matplotlib set up for kvjax: the one way kvjax imports it. A figure is then saved by
kvjax.utils.output_files.save_figure (atomically)."""
from __future__ import annotations

import os

from kvjax.utils.cache_folder import cache_dir


def pyplot():
    """matplotlib.pyplot on the Agg backend, the one way kvjax imports matplotlib: its config and font
    cache go to cache_dir()/matplotlib (kvjax's one cache folder, ~/.cache/kvjax unless KVJAX_CACHE or
    XDG_CACHE_HOME says otherwise), not to matplotlib's own ~/.matplotlib or ~/.config/matplotlib,
    unless the user set MPLCONFIGDIR (read when matplotlib is first imported)."""
    os.environ.setdefault("MPLCONFIGDIR", os.path.join(cache_dir(), "matplotlib"))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
