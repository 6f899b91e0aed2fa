"""`kvjax accuracy`: quantized KV variants against bf16 on held-out text (experiments.fp8_accuracy)."""
from __future__ import annotations


def add_parser(sub) -> None:
    from experiments.fp8_accuracy import __doc__ as doc, add_arguments

    p = sub.add_parser("accuracy", help="fp8 / int8 KV against bf16: perplexity, KL, agreement",
                       description=doc.split("\n\n")[0])
    add_arguments(p)
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")


def run(args) -> int:
    import json

    from experiments.fp8_accuracy import markdown, run_from_args

    res = run_from_args(args)
    print(json.dumps(res, indent=2) if args.json else markdown(res) + "\nwrote " + ", ".join(res["outputs"].values()))
    return 0
