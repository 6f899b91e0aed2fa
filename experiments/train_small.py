"""Train kvjax's built-in small models on the Python standard library's source (byte tokens).

Public weights cannot be downloaded here, so kvjax trains its own two small decoders, one per
attention family, and ships them as Hugging Face folders (config.json + model.safetensors)
under `models/checkpoints/` (copied there from this script's --out folder by hand):

    small-gqa  Llama-style, 4 layers, hidden 128, 4 query heads sharing 2 kv heads of dim 32
    small-mla  DeepSeek-V3-style MLA, 4 dense layers, hidden 128, 4 heads, kv_lora_rank 64,
               qk_rope_head_dim 16 (the cache holds 80 lanes per token per layer)

Training runs through the same paged-cache forward the engine serves with (kvjax.evaluation.scoring),
in float32 with AdamW, on fixed-length windows sampled from the training split (see
experiments/corpus.py). It reports held-out perplexity per byte on the shipped held-out text.

    python -m kvjax.experiments.train_small        # both models, the shipped settings, into ./checkpoints/
    python -m kvjax.experiments.train_small --model gqa --steps 50 --out /tmp/ckpt   # a quick smoke run

It needs optax (`pip install 'kvjax[train]'`).
"""
from __future__ import annotations

import argparse
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.evaluation.scoring import next_token_nll, sequence_logits, windows
from kvjax.experiments import corpus, require
from kvjax.models import build_model, from_hf_config, init_params
from kvjax.models.loader import load_checkpoint, save_checkpoint
from kvjax.utils.output_files import write_json
from kvjax.utils.strict_json import dumps

PROG = "python -m kvjax.experiments.train_small"
CHECKPOINTS = "checkpoints"  # in the current directory, never the installed package's own

HF_CONFIGS = {
    "gqa": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 128,
        "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "dtype": "float32",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
    },
    "mla": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 256,
        "hidden_size": 128, "intermediate_size": 384, "moe_intermediate_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 64,
        "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32, "first_k_dense_replace": 4,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "hidden_act": "silu", "rope_interleave": True,
        "tie_word_embeddings": False, "attention_bias": False, "dtype": "float32",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
    },
}


def heldout_perplexity(model, params, kv_spec, tokens: np.ndarray, seq_len: int = 256, max_windows: int = 64,
                       batch: int = 16) -> dict:
    """Perplexity per byte over non-overlapping held-out windows (first max_windows of them)."""
    rows = windows(tokens, seq_len, max_windows)
    n = len(rows)
    score = jax.jit(lambda p, t: next_token_nll(sequence_logits(model, p, t, kv_spec), t))
    nll = np.concatenate([np.asarray(score(params, jnp.asarray(rows[i:i + batch])))
                          for i in range(0, n, batch)])
    mean = float(nll.mean())
    return {"windows": n, "seq_len": seq_len, "nll": mean, "perplexity": math.exp(mean),
            "bits_per_byte": mean / math.log(2)}


def train(name: str, steps: int, batch: int, seq_len: int, lr: float, seed: int, log_every: int,
          out_dir: str = CHECKPOINTS, heldout: str = corpus.HELDOUT) -> dict:
    optax = require("optax", "train", PROG)
    hf = HF_CONFIGS[name]
    config = from_hf_config(hf)
    model = build_model(config)
    kv_spec = config.kv_spec()
    params = init_params(model, jax.random.key(seed))
    data = corpus.tokens_of(corpus.load_split("train"))
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, min(200, steps // 10 + 1), steps, lr / 10)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    opt_state = opt.init(params)

    def loss_fn(p, toks):
        return next_token_nll(sequence_logits(model, p, toks, kv_spec), toks).mean()

    @jax.jit
    def step(p, s, toks):
        loss, grads = jax.value_and_grad(loss_fn)(p, toks)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    rng = np.random.default_rng(seed)
    start, losses = time.time(), []
    for i in range(steps):
        offsets = rng.integers(0, len(data) - seq_len, size=batch)
        toks = jnp.asarray(np.stack([data[o:o + seq_len] for o in offsets]))
        params, opt_state, loss = step(params, opt_state, toks)
        losses.append(float(loss))
        if log_every and (i % log_every == 0 or i == steps - 1):
            print(f"[{name}] step {i:5d}  loss {np.mean(losses[-log_every:]):.4f}  "
                  f"{time.time() - start:6.1f}s", flush=True)
    seconds = time.time() - start
    folder = os.path.join(out_dir, f"small-{name}")
    save_checkpoint(folder, hf, params)
    # Evaluate the checkpoint as shipped (through the loader), not the in-memory params.
    config, loaded = load_checkpoint(folder)
    model = build_model(config)
    ppl = heldout_perplexity(model, loaded, config.kv_spec(), corpus.read_tokens(heldout))
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(loaded))
    report = {"model": f"small-{name}", "params": n_params, "steps": steps, "batch": batch, "seq_len": seq_len,
              "lr": lr, "seed": seed, "train_seconds": round(seconds, 1), "final_train_loss": float(np.mean(losses[-50:])),
              "heldout": ppl, "machine": f"{jax.devices()[0].platform}, {os.cpu_count()} cores",
              "corpus": "Python standard library source (experiments/corpus.py), byte tokens"}
    write_json(os.path.join(folder, "training.json"), report, "--out")
    return report


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["gqa", "mla", "both"], default="both")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--write-data", action="store_true",
                    help="write this stdlib's held-out and calibration text into --out and score that held-out text "
                         "(to ship: copy both into kvjax/data/)")
    ap.add_argument("--out", default=CHECKPOINTS, help="folder for the checkpoint folders (default: ./checkpoints)")
    args = ap.parse_args(argv)
    heldout = corpus.write_data(args.out)[0] if args.write_data else corpus.HELDOUT
    for name in (["gqa", "mla"] if args.model == "both" else [args.model]):
        report = train(name, args.steps, args.batch, args.seq_len, args.lr, args.seed, args.log_every, args.out,
                       heldout)
        print(dumps(report, indent=2))


if __name__ == "__main__":
    main()
