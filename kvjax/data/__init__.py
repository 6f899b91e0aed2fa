"""Text shipped with kvjax: the held-out and calibration splits of the built-in models' corpus.

The built-in models (models/checkpoints/) learned from the Python standard library's own source
(experiments/corpus.py builds that corpus and wrote these files from the stdlib of the Python
that trained them), so evaluations do not depend on the local Python. Python Software
Foundation License.
"""
import os

DATA_DIR = os.path.dirname(os.path.abspath(__file__))
HELDOUT = os.path.join(DATA_DIR, "stdlib_heldout.txt")  # first 256 KiB of the held-out files
CALIB = os.path.join(DATA_DIR, "stdlib_calib.txt")  # 64 KiB of training text, for fp8 calibration
