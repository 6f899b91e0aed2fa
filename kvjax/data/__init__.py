"""Text shipped with kvjax: the held-out and calibration splits of the built-in models' corpus,
English prose for evaluating real LLMs, and chat prompts for decoding with one.

The built-in models (models/checkpoints/) learned from the Python standard library's own source
(experiments/corpus.py builds that corpus and wrote these files from the stdlib of the Python
that trained them), so evaluations do not depend on the local Python. Python Software
Foundation License.

pydoc_topics.txt is English prose: the first 128 KiB (cut at a paragraph break) of CPython
3.11.7's `Lib/pydoc_data/topics.py`, its `topics` entries (the Language Reference sections that
`help()` shows) joined by blank lines in the dict's order. Shipped rather than read from the
running interpreter because every Python version has different text. Python Software
Foundation License (CPython's `LICENSE`, PSF License Agreement version 2), like the stdlib
splits.

chat_prompts.txt: eight short user questions written for kvjax (one per line), for
`kvjax decode --chat` and the report's real-model decode run.
"""
import os

DATA_DIR = os.path.dirname(os.path.abspath(__file__))
HELDOUT = os.path.join(DATA_DIR, "stdlib_heldout.txt")  # first 256 KiB of the held-out files
CALIB = os.path.join(DATA_DIR, "stdlib_calib.txt")  # 64 KiB of training text, for fp8 calibration
PROSE = os.path.join(DATA_DIR, "pydoc_topics.txt")  # 128 KiB of the Python Language Reference's prose
CHAT_PROMPTS = os.path.join(DATA_DIR, "chat_prompts.txt")  # user messages, one per line
