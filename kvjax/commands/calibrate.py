"""`kvjax calibrate`: fp8 KV scales from the model's own K/V over calibration text (kvjax.quant.calibration).

    kvjax calibrate --model small-gqa --data text.txt --mode per_head --out scales.json

The scales file this writes is what `kvjax decode --scales` and `kvjax.LLM(scales=...)` load.
It prints one line saying what it wrote, or with --json one object: the file, the format, the
mode, the windows calibrated on, and the scales themselves (as in the file).
"""
from __future__ import annotations


from kvjax.commands.common import add_model_flags, add_progress_flag, model_dtype, progress_enabled
from kvjax.errors import UsageError
from kvjax.progress import Phases
from kvjax.quant.kv_formats import FP8_FORMATS
from kvjax.utils.checks import int_arg
from kvjax.utils.input_files import check_input_file
from kvjax.utils.output_files import check_output_file
from kvjax.utils.strict_json import dumps


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="fp8 KV scales from a model run over calibration text",
                       description=__doc__.split("\n\n")[0])
    add_model_flags(p)
    p.add_argument("--data", required=True, help="calibration text file")
    p.add_argument("--mode", choices=["per_tensor", "per_head", "dynamic"], default="per_tensor",
                   help="per_tensor: amax / format max per layer; per_head: per kv head; dynamic: vLLM's "
                        "calc_kv_scales, max |k| / 200 and max |v| / 100 per layer (use --max-windows for its "
                        "first batch)")
    p.add_argument("--format", choices=list(FP8_FORMATS), default="fp8_e4m3")
    p.add_argument("--seq-len", type=int_arg(1), default=256, help="tokens per calibration window (256)")
    p.add_argument("--max-windows", type=int_arg(1), default=32, help="windows at most (32)")
    p.add_argument("--out", required=True, help="scales file to write (JSON)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the line")
    add_progress_flag(p)


def run(args) -> int:
    from kvjax.evaluation.scoring import windows
    from kvjax.models.hub import load_model
    from kvjax.quant.calibration import calibrate

    check_output_file(args.out, "--out")
    check_input_file(args.data, "--data")
    show = progress_enabled(args)
    loaded = load_model(args.model, dtype=model_dtype(args), progress=show)  # its own bar: fetch, read the weights, build
    if args.seq_len > loaded.config.max_position_embeddings:
        raise UsageError(f"--seq-len {args.seq_len} exceeds the model's maximum length "
                         f"{loaded.config.max_position_embeddings}")
    with Phases("calibrate", 2, show) as phases:
        phases.start(f"tokenize {args.data}")
        tokens = loaded.tokenizer.encode_file(args.data)
        if len(tokens) < args.seq_len:
            raise UsageError(f"--data {args.data!r} holds {len(tokens)} tokens, fewer than one window of --seq-len "
                             f"{args.seq_len}")
        toks = windows(tokens, args.seq_len, args.max_windows)
        phases.start(f"prefill {len(toks)} windows and take max |K|, |V| (compiles first)")
        scales = calibrate(loaded.config, loaded.module, loaded.params, toks, args.format, args.mode)
    scales.save(args.out)
    if args.json:
        print(dumps(dict(out=args.out, model=args.model, format=args.format, mode=args.mode,
                         layers=loaded.config.num_layers, windows=len(toks), seq_len=args.seq_len,
                         scales=scales.to_json()), indent=1))
    else:
        print(f"wrote {args.format} {args.mode} scales for {loaded.config.num_layers} layers from {len(toks)} "
              f"windows of {args.seq_len} tokens to {args.out}")
    return 0
