"""`kvjax accuracy`'s task-level sections: the passkey tables, the trade-off table
(kvjax.evaluation.tradeoff) and their plots. kvjax.commands.accuracy renders the rest."""
from __future__ import annotations

import numpy as np

from kvjax.markdown import markdown_table
from kvjax.utils.output_files import save_figure
from kvjax.utils.plotting import pyplot


def save_plot(plt, fig, path: str) -> None:
    fig.tight_layout()
    save_figure(fig, path, "--out", dpi=110)
    plt.close(fig)


def _k(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _rate(c: dict) -> str:
    return f"{100 * c['success']:.0f}% [{100 * c['low']:.0f}–{100 * c['high']:.0f}]"


def _repeated(pk: dict) -> str:
    copies = pk.get("haystack_copies", 1)  # absent from results written before the haystack could repeat
    return f" ({pk['haystack_tokens']:,} tokens, repeated {copies} times end to start)" if copies > 1 else ""


def passkey_markdown(res: dict) -> str:
    pk = res["passkey"]
    lengths = sorted({t["length"] for t in pk["trials"]})
    cells = sorted({(t["length"], t["depth"]) for t in pk["trials"]})
    caption = (f"Passkey retrieval (kvjax.evaluation.passkey): a five-digit number at a depth of a haystack of "
               f"{pk['data']}{_repeated(pk)}, asked for at the end, answered greedily ({pk['answer_tokens']} "
               "tokens). "
               f"{pk['trials_per_cell']} trials per length × depth cell ({pk['per_haystack']} keys per haystack "
               f"offset), pooled over depths {', '.join(f'{d:g}' for d in pk['depths'])} below: success with its "
               f"Wilson 95% interval, then agreement with bf16's answers in parentheses.\n")
    rows = []
    for name, by_len in pk["lengths"].items():
        got = {c["length"]: c for c in by_len}
        rows.append([name] + [f"{_rate(got[n])} ({100 * got[n]['agree']:.0f}%)" for n in lengths])
    table = markdown_table(["KV variant"] + [f"{_k(n)} ({got[n]['trials']} trials)" for n in lengths], rows,
                           align="l" + "r" * len(lengths))
    rows = []
    for name, by_cell in pk["cells"].items():
        got = {(c["length"], c["depth"]): c for c in by_cell}
        rows.append([name] + [f"{100 * got[c]['success']:.0f}%" for c in cells])
    by_cell = markdown_table(["KV variant"] + [f"{_k(n)} @ {d:g}" for n, d in cells], rows,
                             align="l" + "r" * len(cells))
    return "\n".join([caption, *table, "", "Success by length @ depth:", "", *by_cell]) + "\n"


def tradeoff_markdown(res: dict, rows: list[dict]) -> str:
    from kvjax.evaluation.tradeoff import DEPLOYMENT

    longest = rows[0]["passkey_length"] if rows else None
    caption = (f"The trade-off. Llama-3-70B columns: KV bytes per token and how many {_k(DEPLOYMENT['context'])} "
               f"requests fit on SPEC's group A ({DEPLOYMENT['gpu_gib']} GiB × {DEPLOYMENT['util']} less "
               f"{DEPLOYMENT['weights_gib']} GiB of bf16 weights, or {DEPLOYMENT['fp8_weights_gib']} GiB of fp8 "
               f"weights); a skip variant keeps as many of its 80 layers in bf16. {res['model']} columns: the "
               f"short windows' perplexity, KL and top-1, KL at positions 2K–8K of the long windows, passkey success"
               f"{' at ' + _k(longest) if longest else ''} (Wilson 95%) and its agreement with bf16, and the mean "
               f"first divergence of {res['prompts']} greedy generations of {res['decode_tokens']} tokens.\n")
    fmt = lambda x, f: "–" if x is None else format(x, f)  # noqa: E731
    body = [[r["variant"], f"{r['bytes_per_token']:,}", r["concurrency"], r["concurrency_fp8_weights"],
             f"{r['perplexity']:.3f}", f"{r['kl_vs_bf16']:.2e}", f"{100 * r['top1_agreement']:.1f}%",
             fmt(r["kl_2k_8k"], ".2e"), _rate(r["passkey"]) if r["passkey"] else "–",
             f"{100 * r['passkey']['agree']:.0f}%" if r["passkey"] else "–",
             f"{r['greedy_tokens_until_divergence']:.1f}"] for r in rows]
    table = markdown_table(["KV format", "70B bytes/token", "70B 8K conc.", "with fp8 weights", "perplexity",
                            "KL", "top-1", "KL 2K–8K", "passkey", "agree", "greedy divergence"], body,
                           align="lrrrrrrrrrr")
    return "\n".join([caption, *table]) + "\n"


def plot_tradeoff(res: dict, rows: list[dict], path: str) -> None:
    """Three panels: KL against Llama-3-70B concurrency, passkey success with intervals, and the
    share of greedy generations still identical to bf16's at each position."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    # one colour per format in the first and last panels; a legend, since formats of one byte width
    # sit at the same concurrency and their labels would overlap
    color = {r["variant"]: f"C{i % 10}" for i, r in enumerate(r for r in rows if r["variant"] != "bf16")}
    ax = axes[0]
    for r in rows:
        if r["variant"] in color:
            ax.scatter(r["concurrency"], max(r["kl_vs_bf16"], 1e-12), color=color[r["variant"]], label=r["variant"])
    ax.legend(fontsize=6)
    ax.set_yscale("log")
    ax.set_xlabel("Llama-3-70B: concurrent 8K requests on group A (bf16 weights)")
    ax.set_ylabel(f"{res['model']}: KL(bf16 ‖ format)")
    ax = axes[1]
    pk = [r for r in rows if r["passkey"]]
    if pk:
        y = np.arange(len(pk))
        s = np.array([100 * r["passkey"]["success"] for r in pk])
        err = np.array([[100 * (r["passkey"]["success"] - r["passkey"]["low"]) for r in pk],
                        [100 * (r["passkey"]["high"] - r["passkey"]["success"]) for r in pk]])
        ax.barh(y, s, xerr=err, color="tab:green", capsize=3)
        ax.set_yticks(y, [r["variant"] for r in pk], fontsize=7)
        ax.set_xlim(0, 100)
        ax.set_xlabel(f"passkey success at {_k(pk[0]['passkey_length'])} (%, Wilson 95%)")
    ax = axes[2]
    for r in res["results"]:
        if r["variant"] in ("bf16", "fp32") or "greedy_divergence" not in r:
            continue
        div = np.asarray(r["greedy_divergence"])
        t = np.arange(res["decode_tokens"] + 1)
        ax.step(t, [(div >= i).mean() for i in t], where="post", label=r["variant"], color=color.get(r["variant"]))
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("share of generations identical to bf16's")
    ax.legend(fontsize=6)
    fig.suptitle(f"{res['model']}: what each KV format saves and costs")
    save_plot(plt, fig, path)
