"""How much accuracy does a quantized KV cache cost against bf16? (kvjax.evaluation.accuracy, as a script)

The evaluation (variants, metrics) is the library's `kvjax.evaluation.accuracy.evaluate`; this script
runs it like `kvjax accuracy` does, writing into ./experiments/results/ by default:

    python -m kvjax.experiments.fp8_accuracy --model small-gqa
    python -m kvjax.experiments.fp8_accuracy --model small-mla --outlier-channels
    python -m kvjax.experiments.fp8_accuracy --model smollm2-135m     # the full suite (README: "fp8 KV accuracy on SmolLM2-135M")
"""
from __future__ import annotations

import argparse

from kvjax.commands.accuracy import add_arguments, run_from_args
from kvjax.evaluation.accuracy import markdown
from kvjax.experiments import RESULTS


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    ap.set_defaults(out=str(RESULTS))
    res = run_from_args(ap.parse_args(argv))
    print(markdown(res))
    print("wrote " + ", ".join(res["outputs"].values()))


if __name__ == "__main__":
    main()
