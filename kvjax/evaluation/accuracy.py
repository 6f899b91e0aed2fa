"""How much accuracy does a quantized KV cache cost against bf16, and how much do scales win back?

For one model and held-out text, every variant below scores the same teacher-forced windows
(`LLM.score_windows`) and greedily decodes the same prompts (`LLM.generate`) through the paged cache;
only the cache's dtype and scales change:

    bf16                            the baseline (vLLM's kv_cache_dtype auto for a bf16 model)
    fp32                            a control: wider than the baseline, so its distance is rounding only
    fp8_e4m3 unit                   vLLM's default `--kv-cache-dtype fp8`: every scale 1.0
    fp8_e4m3 dynamic                vLLM's `--calculate-kv-scales` (until 0.19): max |k| / 200, max |v| / 100
                                    per layer over the first batch, here the first scored windows
    fp8_e4m3 per_tensor             one calibrated scale per layer for K and for V (amax / 448)
    fp8_e4m3 per_head               one calibrated scale per layer per kv head
    fp8_e5m2 unit                   the wider-range, coarser format at scale 1.0
    int8_per_token_head             a scale per token per head, computed at write time
    fp8_per_token_head              the same in e4m3 (vLLM 0.33's per-token-head kernel)
    nvfp4                           E2M1 values with an e4m3 scale per 16, per-tensor scale 1.0 (kvjax.quant.nvfp4)
    fp8_e4m3 per_tensor skip 0,L-1  the first and last layers kept in bf16 (the model dtype in vLLM)

Metrics per variant: perplexity per token, mean KL(bf16 ‖ variant) of the next-token
distributions, top-1 agreement with bf16, greedy-decode agreement (tokens until the first
divergence from bf16's continuation, over a set of prompts), and bf16's greedy continuation
replayed through the variant's engine (vLLM's trace replay, `replay`: the variant decodes those
known tokens step by step through its paged cache): their mean negative log-probability and how
often each is still the variant's most likely token, with no divergence compounding. `outlier_channels` inflates a few cached
K channels (models.stress; the model's function is unchanged) to mimic the outliers of large
models.

The full suite for a real LLM (`FULL_SUITE`, what `kvjax accuracy` runs for any model but the
built-in byte-level ones) adds:

- held-out text from several sources (code and English prose), windows split between them;
- an outlier map (kvjax.evaluation.layers.kv_outliers) of the calibration text's K/V;
- layer sensitivity (kvjax.evaluation.layers.layer_sensitivity) on a slice of the calibration
  text — not the held-out text, so choosing layers does not peek at what is scored —, which
  replaces the fixed skip variant by "<variant> skip <the k most sensitive layers>";
- KL by context position in buckets (kvjax.evaluation.metrics.BUCKETS), over a long window of the
  model's context (8,192 tokens for SmolLM2; at most `LONG_LEN` unless `long_len` asks for more, up
  to the model's context: RoPE scaled as its config says) for every variant, prefilled in chunks;
- passkey retrieval (kvjax.evaluation.passkey) at 1,024 tokens, 12 trials at each of three depths,
  through every variant but fp32, and free generations of 128 tokens for the first greedy
  divergence; kvjax.evaluation.tradeoff puts it all in one table beside Llama-3-70B's bytes.

Memory: windows are the outer loop and variants the inner one; each variant's batch is compared
with the baseline's at once and only per-position sums are kept (kvjax.evaluation.metrics), so
no variant's full distributions outlive its batch. `kvjax accuracy` (kvjax.commands.accuracy)
runs this and renders the results; nothing here renders.

This is the API layer: it loads models through `models/` (lazily), as kvjax.engine.llm does.
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.data import HELDOUT, PROSE
from kvjax.engine.llm import LLM
from kvjax.engine.sampling import SamplingParams
from kvjax.engine.stats import COMPILE_S
from kvjax.errors import KvjaxError
from kvjax.evaluation.layers import kv_outliers, layer_sensitivity, most_sensitive
from kvjax.evaluation.metrics import BUCKETS, Tally, compare
from kvjax.evaluation.scoring import ChunkedScorer, windows
from kvjax.quant import nvfp4
from kvjax.quant.calibration import calibrate, channel_amax
from kvjax.utils.checks import check_int

# What `kvjax accuracy` measures on a real LLM (any model but the built-in small-gqa / small-mla),
# sized for SmolLM2-135M on 2 CPU cores (docs/accuracy.md: its time, phase by phase).
FULL_SUITE = dict(data=(HELDOUT, PROSE), seq_len=256, max_windows=32, calib_windows=8, long_windows=1,
                  long_chunk=2048, long_variants="all", sensitivity_windows=2,
                  sensitivity_variant="fp8_e4m3 unit", skip_counts=(3,), outlier_map=True, prompts=8,
                  decode_tokens=128, passkey_lengths=(1024,), passkey_trials=12)
# The long windows' default length where the model has more context: SmolLM2's whole 8K. Longer
# windows (long_len, `kvjax accuracy --long-len`, up to the model's context) cost more than
# proportionally on a CPU: every chunk attends to all the positions before it.
LONG_LEN = 8192


def variants(num_layers: int, skip_sets: dict[str, list[tuple[int, ...]]] | None = None,
             nvfp4: bool = True) -> list[dict]:
    """The variant list. skip_sets {variant name: [layer tuples]} replaces the fixed
    "fp8_e4m3 per_tensor skip 0,L-1" by one skip variant of that variant per layer tuple.
    nvfp4=False leaves nvfp4 out (MLA latents and head dims that are not multiples of 16 have no
    nvfp4 page here; kvjax.worker.paged_cache)."""
    base = [
        dict(name="bf16", kv_dtype="bf16"),
        dict(name="fp32", kv_dtype="fp32"),
        dict(name="fp8_e4m3 unit", kv_dtype="fp8_e4m3", mode="unit"),
        dict(name="fp8_e4m3 dynamic", kv_dtype="fp8_e4m3", mode="dynamic"),
        dict(name="fp8_e4m3 per_tensor", kv_dtype="fp8_e4m3", mode="per_tensor"),
        dict(name="fp8_e4m3 per_head", kv_dtype="fp8_e4m3", mode="per_head"),
        dict(name="fp8_e5m2 unit", kv_dtype="fp8_e5m2", mode="unit"),
        dict(name="int8_per_token_head", kv_dtype="int8_per_token_head"),
        dict(name="fp8_per_token_head", kv_dtype="fp8_per_token_head"),
        dict(name="nvfp4", kv_dtype="nvfp4"),
    ]
    if not nvfp4:
        base = [v for v in base if v["kv_dtype"] != "nvfp4"]
    if skip_sets is None:
        skip_sets = {"fp8_e4m3 per_tensor": [(0, num_layers - 1)]}
    by_name = {v["name"]: v for v in base}
    for name, sets in skip_sets.items():
        for layers in sets:
            base.append(dict(by_name[name], name=f"{name} skip {','.join(map(str, layers))}", skip=tuple(layers)))
    return base


def _sources(tokenizer, data, seq_len: int, max_windows: int, long_windows: int, long_len: int,
             prompts: int, prompt_len: int):
    """Split every source's tokens into (main windows, long windows, greedy prompts), in that
    order along the text. Main windows: max_windows split evenly (earlier sources take the
    remainder); long window j comes from source j % n; prompt i from source i % n, after that
    source's windows (or from its start if too little is left)."""
    paths = [data] if isinstance(data, str) else list(data)
    n = len(paths)
    main, long, prompt_list, info = [], [], [None] * prompts, []
    for s, path in enumerate(paths):
        tokens = tokenizer.encode_file(path)
        quota = max_windows // n + (s < max_windows % n)
        if quota == 0:
            raise KvjaxError(f"max_windows {max_windows} leaves no window for {n} data sources")
        mine = windows(tokens, seq_len, quota)
        used = len(mine) * seq_len
        n_long = len(range(s, long_windows, n))
        if n_long:
            if len(tokens) - used < n_long * long_len:
                raise KvjaxError(f"{path}: {len(tokens):,} tokens hold {len(mine)} windows of {seq_len} but not "
                                 f"{n_long} more of {long_len} (long windows)")
            long.append(np.asarray(tokens[used:used + n_long * long_len]).reshape(n_long, long_len))
            used += n_long * long_len
        rest = tokens[used:]
        mine_prompts = range(s, prompts, n)
        rest = rest if len(rest) >= len(mine_prompts) * prompt_len else tokens
        for j, i in enumerate(mine_prompts):
            prompt_list[i] = rest[j * prompt_len:(j + 1) * prompt_len].tolist()
        main.append(mine)
        info.append(dict(path=os.path.relpath(path), tokens=int(len(tokens)), windows=int(len(mine))))
    long_arr = np.concatenate(long) if long else np.zeros((0, long_len), np.int64)
    return np.concatenate(main), long_arr, prompt_list, info


def evaluate(model, data, calib: str, *, seq_len: int = 256, max_windows: int = 32,
             prompts: int = 8, prompt_len: int = 64, decode_tokens: int = 32, outlier_channels: bool = False,
             outlier_factor: float = 200.0, block_size: int = 16, calib_windows: int | None = None,
             outlier_map: bool = False, sensitivity_windows: int = 0, sensitivity_variant: str = "fp8_e4m3 unit",
             skip_counts: tuple[int, ...] = (1, 3), long_windows: int = 0, long_len: int | None = None,
             long_chunk: int = 512, long_variants: tuple[str, ...] = ("fp8_e4m3 unit",),
             only: tuple[str, ...] | None = None, passkey_lengths: tuple[int, ...] = (),
             passkey_depths: tuple[float, ...] = (0.1, 0.5, 0.9), passkey_trials: int = 12, passkey_per_haystack: int = 3,
             passkey_data: str = PROSE, progress: Callable[[str], None] | None = None) -> dict:
    """Run every variant on `model` (anything models.hub.load_model takes, or a LoadedModel)
    with held-out text `data` (a path, or several: windows are split between them) and
    calibration text `calib`; returns the results as a JSON-safe dict.

    calib_windows: calibration windows of seq_len (default max_windows). outlier_map: measure
    kv_outliers on them. sensitivity_windows > 0: measure layer_sensitivity of
    sensitivity_variant on that many calibration windows, and make one skip variant per k in
    skip_counts (its k most sensitive layers in bf16). long_windows > 0: also score that many
    windows of long_len tokens (default the model's context, at most LONG_LEN = 8,192) with bf16 and
    long_variants ("all": every scored variant but fp32), prefilled long_chunk tokens at a time, for
    KL by context position.
    passkey_lengths: prompt lengths of the passkey task (kvjax.evaluation.passkey; empty: off), each
    at every depth of passkey_depths with passkey_trials trials, passkey_per_haystack of them
    sharing one haystack offset of passkey_data, through every scored variant but fp32.
    only: the variants to score (bf16, the baseline, always comes first; a skip variant is named
    by its base, e.g. "fp8_e4m3 unit" keeps "fp8_e4m3 unit skip 3"; nvfp4 is left out where the model has no
    nvfp4 page); None scores them all.
    progress(message) is called as each phase starts (the library never prints).
    """
    from kvjax.models.hub import LoadedModel, load_model

    for name, value in (("seq_len", seq_len), ("max_windows", max_windows), ("prompts", prompts),
                        ("prompt_len", prompt_len), ("decode_tokens", decode_tokens), ("long_chunk", long_chunk)):
        check_int(value, name, 1, None)
    for name, value in (("long_windows", long_windows), ("sensitivity_windows", sensitivity_windows)):
        check_int(value, name, 0, None)
    start = time.time()
    phases, compiles = {}, {}  # per phase: wall seconds, and the seconds of them JAX spent compiling

    @contextlib.contextmanager
    def phase(name):
        t, c = time.time(), COMPILE_S[0]
        yield
        phases[name], compiles[name] = time.time() - t, COMPILE_S[0] - c
    say = progress or (lambda message: None)
    loaded = model if isinstance(model, LoadedModel) else load_model(model)
    model_name = loaded.name
    config = loaded.config
    if config.mamba is not None and sensitivity_windows:  # its skip variants keep some attention layers in bf16
        raise KvjaxError(f"{model_name}: layer sensitivity and its skip variants need per-layer KV dtypes, which vLLM's "
                         "one page size beside Mamba layers does not allow: pass sensitivity_windows=0")
    packs_nvfp4 = nvfp4.page_refusal(config.kv_spec().kind, config.head_dim) is None
    known = {v["name"]: v for v in variants(config.num_layers)}  # every name; this model's below
    if isinstance(long_variants, str) and long_variants != "all":
        raise KvjaxError(f"long_variants must be variant names or 'all', got {long_variants!r}")
    for name in (sensitivity_variant, *(() if long_variants == "all" else long_variants), *(only or ())):
        if name not in known:
            raise KvjaxError(f"unknown variant {name!r}; choose one of {', '.join(known)}")
    if seq_len > config.max_position_embeddings:
        raise KvjaxError(f"seq_len {seq_len} exceeds the model's maximum length {config.max_position_embeddings}")
    if outlier_channels:
        from kvjax.models.stress import inflate_k_channels
        params = inflate_k_channels(config, loaded.params, (0, 5), outlier_factor)
        loaded = loaded.replace(params=jax.tree_util.tree_map(jnp.asarray, params))
    long_len = long_len or min(config.max_position_embeddings, LONG_LEN)
    if long_windows and not seq_len < long_len <= min(config.max_position_embeddings, BUCKETS[-1]):
        raise KvjaxError(f"long_len {long_len} must exceed seq_len {seq_len} and stay within the model's context "
                         f"{config.max_position_embeddings} and the last position bucket {BUCKETS[-1]}")
    eval_windows, long_set, prompt_list, sources = _sources(loaded.tokenizer, data, seq_len, max_windows,
                                                            long_windows, long_len, prompts, prompt_len)
    calib_windows = windows(loaded.tokenizer.encode_file(calib), seq_len, calib_windows or max_windows)
    passkey_plan = _passkey_plan(loaded, passkey_data, passkey_lengths, passkey_depths, passkey_trials,
                                 passkey_per_haystack) if passkey_lengths else None  # refused before any work
    phases["load"] = time.time() - start

    # Scales, outliers and layer sensitivity all read the calibration split only, prefilled once:
    # its per-channel amax serve every calibrated mode and the outlier map.
    calibrated, calib_channels = {}, []

    def channels():
        if not calib_channels:
            calib_channels.append(channel_amax(config, loaded.module, loaded.params, calib_windows, block_size))
        return calib_channels[0]

    def scales_for(v):
        mode = v.get("mode", "unit")
        if mode == "unit":
            return None
        if (v["kv_dtype"], mode) not in calibrated:  # dynamic: vLLM's first batch, the first scored one
            dynamic = mode == "dynamic"
            data = eval_windows[:max(1, 2048 // seq_len)] if dynamic else calib_windows
            calibrated[v["kv_dtype"], mode] = calibrate(config, loaded.module, loaded.params, data, v["kv_dtype"],
                                                        mode, block_size, channels=None if dynamic else channels())
        return calibrated[v["kv_dtype"], mode]

    outliers = sensitivity = None
    if outlier_map:
        say(f"outlier map on {len(calib_windows)} calibration windows")
        with phase("outlier_map"):
            outliers = kv_outliers(config, loaded.module, loaded.params, calib_windows, block_size=block_size,
                                   channels=channels())
    skip_sets = None
    if sensitivity_windows:
        say(f"layer sensitivity of {sensitivity_variant}: {config.num_layers} layers")
        with phase("sensitivity"):
            sv = known[sensitivity_variant]
            rows = layer_sensitivity(loaded, calib_windows[:sensitivity_windows], sv["kv_dtype"], scales_for(sv),
                                     block_size=block_size)
        skip_sets = {sensitivity_variant: [tuple(most_sensitive(rows, k)) for k in skip_counts]}
        sensitivity = dict(variant=sensitivity_variant, windows=int(min(sensitivity_windows, len(calib_windows))),
                           seq_len=seq_len, layers=rows, skip_sets=[list(s) for s in skip_sets[sensitivity_variant]])

    # Skipped layers stay at the baseline's bf16 (vLLM keeps them in the model dtype, bf16 there);
    # one pool with a row per prompt, long enough for prompt and continuation: nothing is preempted.
    # Every layer gets its own pages (no hybrid KV cache groups, which share one page tensor among
    # a group's layers and so cannot hold per-layer scales or skipped layers); the groups change
    # which blocks are kept, never a logit.
    vlist = variants(config.num_layers, skip_sets, nvfp4=packs_nvfp4)
    if only is not None:
        vlist = [v for v in vlist if v["name"] == "bf16" or v["name"].split(" skip ")[0] in only]
    say(f"calibration; scoring {len(eval_windows)} windows of {seq_len} with {len(vlist)} variants")
    with phase("calibration"):
        llms = {v["name"]: LLM(loaded, kv_cache_dtype=v["kv_dtype"], scales=scales_for(v),
                               kv_cache_dtype_skip_layers=v.get("skip", ()),
                               kv_skip_dtype="bf16", block_size=block_size, max_num_seqs=prompts,
                               disable_hybrid_kv_cache_manager=config.mamba is None,  # Mamba: groups only
                               max_model_len=prompt_len + decode_tokens + 1, steps_per_call=8,
                               enable_trace_replay=True) for v in vlist}
    with phase("score"):
        tallies = _score_short(llms, eval_windows)
    say(f"greedy decoding: {prompts} prompts × {decode_tokens} tokens per variant")
    greedy_params = SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True)  # decode_tokens tokens
    greedy_of = {}
    with phase("greedy"):
        for v in vlist:
            outs = llms[v["name"]].generate(prompt_list, greedy_params, use_tqdm=False)
            greedy_of[v["name"]] = np.asarray([o.outputs[0].token_ids for o in outs])
    base_greedy = greedy_of[vlist[0]["name"]]
    say("replaying bf16's greedy continuations through every variant")
    with phase("replay"):
        replayed = {v["name"]: replay(llms[v["name"]], prompt_list, base_greedy) for v in vlist}
    results = []
    for v in vlist:
        llm = llms[v["name"]]
        greedy = greedy_of[v["name"]]
        replay_lps, replay_ranks = replayed[v["name"]]
        same = greedy == base_greedy
        until = np.where(same.all(1), decode_tokens, np.argmin(same, axis=1))  # first divergence per prompt
        overall = tallies[v["name"]].overall()
        results.append(dict(variant=v["name"], kv_dtype=v["kv_dtype"], scale_mode=v.get("mode", "-"),
                            skip_layers=list(v.get("skip", ())), bytes_per_token=llm.kv_spec.bytes_per_token,
                            perplexity=overall["perplexity"], nll=overall["nll"], kl_vs_bf16=overall["kl_vs_bf16"],
                            top1_agreement=overall["top1_agreement"],
                            greedy_tokens_until_divergence=float(until.mean()),
                            greedy_divergence=[int(u) for u in until],
                            greedy_identical=int(same.all(1).sum()),
                            replay_nll=float(-replay_lps.mean()), replay_top1=float((replay_ranks == 1).mean())))

    res = dict(model=model_name, data=sources[0]["path"] if len(sources) == 1 else [s["path"] for s in sources],
               calibration=os.path.relpath(calib), windows=int(len(eval_windows)), seq_len=seq_len,
               scored_tokens=int(len(eval_windows) * (seq_len - 1)), prompts=prompts, prompt_len=prompt_len,
               decode_tokens=decode_tokens, outlier_channels=outlier_channels,
               outlier_factor=outlier_factor if outlier_channels else None,
               machine=f"{jax.devices()[0].platform} ({jax.devices()[0].device_kind}), jax {jax.__version__}",
               results=results, sources=sources, calib_windows=int(len(calib_windows)),
               positions=dict(seq_len=seq_len, windows=int(len(eval_windows)),
                              variants={name: tl.buckets() for name, tl in tallies.items()}))
    del llms, tallies
    if passkey_lengths:
        with phase("passkey"):
            res["passkey"] = _passkey(loaded, vlist, scales_for, passkey_plan, block_size, say)
    if long_windows:
        lv = ([v for v in vlist if v["name"] not in ("bf16", "fp32")] if long_variants == "all"
              else [known[n] for n in long_variants])
        say(f"long windows: {long_windows} × {long_len} tokens, bf16 and {', '.join(v['name'] for v in lv)}")
        with phase("long"):
            res["long"] = _score_long(loaded, [known["bf16"]] + lv, scales_for, long_set, long_chunk, block_size)
    if outliers is not None:
        res["outliers"] = outliers
    if sensitivity is not None:
        res["sensitivity"] = sensitivity
    res["phase_seconds"] = {k: round(v, 1) for k, v in phases.items()}
    res["phase_compile_seconds"] = {k: round(v, 1) for k, v in compiles.items()}
    res["seconds"] = round(time.time() - start, 1)
    return res


def replay(llm: LLM, prompts: list[list[int]], continuations) -> tuple[np.ndarray, np.ndarray]:
    """(log-probabilities f32[P, T], ranks i32[P, T]) of known continuations i32[P, T] after each
    prompt, read through llm's engine: vLLM's trace replay emits them one decode step at a time
    through the paged cache and the scheduler (an LLM built with enable_trace_replay=True), so the
    numbers are those of the variant's own decode path on the same tokens."""
    params = [SamplingParams(trace_decode_token_ids=[int(t) for t in row], max_tokens=len(row), logprobs=0)
              for row in continuations]
    outs = llm.generate([list(p) for p in prompts], params, use_tqdm=False)
    chosen = [[lp[t] for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]
    return (np.array([[c.logprob for c in row] for row in chosen], np.float32),
            np.array([[c.rank for c in row] for row in chosen], np.int32))


def _score_short(llms: dict, eval_windows: np.ndarray) -> dict[str, Tally]:
    """Windows outer, variants inner: each batch is scored by the baseline (the first LLM) and
    then every variant, compared at once, and only the sums are kept."""
    seq_len = eval_windows.shape[1]
    batch = max(1, 2048 // seq_len)  # ≤ 2,048 positions of log-probs per variant at a time
    positions = np.arange(seq_len - 1)
    edges = BUCKETS if seq_len - 1 <= BUCKETS[-1] else BUCKETS + (seq_len,)
    tallies = {name: Tally(edges) for name in llms}
    for i in range(0, len(eval_windows), batch):
        part = eval_windows[i:i + batch]
        targets = jnp.asarray(part[:, 1:], jnp.int32)
        base = None
        for name, llm in llms.items():
            logp = jnp.asarray(llm.score_windows(part, batch)[:, :-1])  # [B, S-1, V] predicting tokens 1..S-1
            base = logp if base is None else base
            tallies[name].add(positions, *compare(base, logp, targets))
    return tallies


def _score_long(loaded, vlist: list[dict], scales_for, long_set: np.ndarray, chunk: int, block_size: int) -> dict:
    """KL by position over long windows: window outer, chunk next, variant inner (the baseline,
    vlist[0], first); every variant keeps its own cache from chunk to chunk."""
    seq_len = long_set.shape[1]
    scorers = {v["name"]: ChunkedScorer(LLM(loaded, kv_cache_dtype=v["kv_dtype"], scales=scales_for(v),
                                            kv_cache_dtype_skip_layers=v.get("skip", ()), kv_skip_dtype="bf16",
                                            block_size=block_size, max_num_seqs=1, max_model_len=block_size),
                                        seq_len, chunk) for v in vlist}
    tallies = {name: Tally() for name in scorers}
    for window in long_set:
        streams = {name: sc.chunks(window) for name, sc in scorers.items()}
        for start, _ in scorers[vlist[0]["name"]].layouts:
            base = None
            for name, stream in streams.items():
                at, logp = next(stream)
                n = min(logp.shape[0], seq_len - 1 - at)  # the window's last position has no target
                logp = logp[:n]
                base = logp if base is None else base
                targets = jnp.asarray(window[at + 1:at + 1 + n], jnp.int32)
                tallies[name].add(np.arange(at, at + n), *compare(base, logp, targets))
    return dict(windows=int(len(long_set)), seq_len=seq_len, chunk=chunk,
                scored_tokens=int(len(long_set) * (seq_len - 1)),
                variants={name: dict(tl.overall(), buckets=tl.buckets()) for name, tl in tallies.items()})


def _passkey_plan(loaded, data: str, lengths, depths, trials: int, per_haystack: int) -> dict:
    """The passkey trials and the haystack, every length checked against the model and the prompt."""
    from kvjax.evaluation import passkey

    text = loaded.tokenizer.encode_file(data)
    haystack, copies = passkey.repeat_haystack(text, max(lengths))
    plan = passkey.plan_trials(len(haystack), lengths, depths, trials, per_haystack)
    if max(lengths) + passkey.ANSWER_TOKENS > loaded.config.max_position_embeddings:
        raise KvjaxError(f"passkey length {max(lengths)} and its {passkey.ANSWER_TOKENS} answer tokens exceed the "
                         f"model's maximum length {loaded.config.max_position_embeddings}")
    passkey.prompt_tokens(loaded.tokenizer, haystack, min(lengths), 0.5, 10_000, 0)  # room for a haystack
    return dict(haystack=haystack, trials=plan, data=data, depths=tuple(depths), trials_per_cell=trials,
                per_haystack=per_haystack, haystack_tokens=int(len(text)), haystack_copies=copies)


def _passkey(loaded, vlist: list[dict], scales_for, plan: dict, block_size: int, say) -> dict:
    """The passkey grid through every variant but the fp32 control, each an LLM of one sequence
    at a time (so trials sharing a haystack offset hit the prefix cache) and room for two."""
    from kvjax.evaluation import passkey
    from kvjax.math_utils import cdiv

    model_len = max(t["length"] for t in plan["trials"]) + passkey.ANSWER_TOKENS
    llms = {v["name"]: LLM(loaded, kv_cache_dtype=v["kv_dtype"], scales=scales_for(v),
                           kv_cache_dtype_skip_layers=v.get("skip", ()), kv_skip_dtype="bf16", block_size=block_size,
                           max_num_seqs=1, max_model_len=model_len, max_num_batched_tokens=2048,
                           num_gpu_blocks_override=2 * cdiv(model_len, block_size) + 1)
            for v in vlist if v["name"] != "fp32"}
    out = passkey.run(llms, loaded.tokenizer, plan["haystack"], plan["trials"], progress=say)
    return dict(out, data=os.path.relpath(plan["data"]), depths=list(plan["depths"]),
                trials_per_cell=plan["trials_per_cell"], per_haystack=plan["per_haystack"],
                answer_tokens=passkey.ANSWER_TOKENS, haystack_tokens=plan["haystack_tokens"],
                haystack_copies=plan["haystack_copies"])
