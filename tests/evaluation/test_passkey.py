"""The passkey task (kvjax.evaluation.passkey): prompts laid out as the docstring says, the trial
plan, answers, Wilson intervals against the textbook formula, the tallies against counts made
here, and, through a real LLM, that the prefix cache which makes the grid affordable serves the
shared haystack without changing a single answer."""

import numpy as np
import pytest

from kvjax import LLM
from kvjax.data import PROSE
from kvjax.errors import KvjaxError
from kvjax.evaluation import passkey
from kvjax.models.hub import load_model


class Bytes:  # a byte-level tokenizer, independent of the models' ones
    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return bytes(ids).decode(errors="replace")


HAY = np.arange(1000, 3000)  # token ids no encoded text uses, so each one's position is visible


@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_prompt_layout(depth):
    tok = Bytes()
    ids, at = passkey.prompt_tokens(tok, HAY, 600, depth, 48213, 17)
    pre, needle, post = (tok.encode(t) for t in (passkey.INTRO, passkey.NEEDLE.format(key=48213), passkey.QUESTION))
    n = 600 - len(pre) - len(needle) - len(post)
    a = round(depth * n)
    assert len(ids) == 600 and at == len(pre) + a
    assert ids[:len(pre)] == pre and ids[len(ids) - len(post):] == post
    assert ids[at:at + len(needle)] == needle and b"48213" in bytes(needle)
    body = ids[len(pre):at] + ids[at + len(needle):len(ids) - len(post)]
    assert body == list(range(1017, 1017 + n))  # the haystack from the offset, unbroken around the needle


def test_prompt_refusals():
    with pytest.raises(KvjaxError, match="leaves no room for a haystack"):
        passkey.prompt_tokens(Bytes(), HAY, 100, 0.5, 12345, 0)
    with pytest.raises(KvjaxError, match="haystack offset 1900"):
        passkey.prompt_tokens(Bytes(), HAY, 600, 0.5, 12345, 1900)
    with pytest.raises(KvjaxError, match="depth must be in"):
        passkey.plan_trials(2000, [600], [1.5], 2, 1)
    with pytest.raises(KvjaxError, match="exceeds the haystack"):
        passkey.plan_trials(500, [600], [0.5], 2, 1)


def test_plan_groups_share_offsets():
    plan = passkey.plan_trials(2000, [300, 600], [0.1, 0.9], 5, 2, seed=4)
    assert len(plan) == 2 * 2 * 5
    cells = [(t["length"], t["depth"]) for t in plan]
    assert cells == [(n, d) for n in (300, 600) for d in (0.1, 0.9) for _ in range(5)]  # cell after cell
    for c in range(4):
        offs = [t["offset"] for t in plan[5 * c:5 * c + 5]]
        assert offs[0] == offs[1] and offs[2] == offs[3]  # two keys per offset, the fifth alone
        assert all(0 <= o <= 2000 - plan[5 * c]["length"] for o in offs)
    assert all(10_000 <= t["key"] < 100_000 for t in plan)
    assert plan == passkey.plan_trials(2000, [300, 600], [0.1, 0.9], 5, 2, seed=4)  # seeded


def test_answer():
    assert passkey.answer(" 48213.\n") == "48213"
    assert passkey.answer(" 48 213") == "48"
    assert passkey.answer("  the number of\n") == "the number of"


def test_wilson_by_hand():
    z = 1.96
    assert passkey.wilson(36, 36)[0] == pytest.approx(36 / (36 + z * z))  # p = 1: lower bound n / (n + z²)
    assert passkey.wilson(36, 36)[1] == 1.0
    assert passkey.wilson(0, 10)[1] == pytest.approx(z * z / (10 + z * z))
    lo, hi = passkey.wilson(5, 10)  # the textbook 0.2366 – 0.7634
    assert (round(lo, 4), round(hi, 4)) == (0.2366, 0.7634)
    assert (36 - 35) / 36 < 0.05 and 1 - passkey.wilson(36, 36)[0] < 0.1  # ±5% at 36 of 36
    with pytest.raises(KvjaxError):
        passkey.wilson(0, 0)


class FakeLLM:
    """Answers from the prompt: the key (reads the needle back), or a wrong key on the listed trials."""

    def __init__(self, wrong=()):
        self.wrong = set(wrong)

    def generate(self, prompts, params, use_tqdm=False):
        class Out:
            pass
        outs = []
        for i, ids in enumerate(prompts):
            text = bytes(t for t in ids if t < 256).decode()
            key = text.split("The secret number is ")[1][:5]
            o = Out()
            o.outputs = [Out()]
            o.outputs[0].token_ids = list(f" {'00000' if i in self.wrong else key}.".encode())
            outs.append(o)
        res = type("Outputs", (list,), {})(outs)
        res.summary = type("S", (), {"prefix_hit_tokens": 0})()
        return res


def test_tallies_against_counts():
    plan = passkey.plan_trials(len(HAY), [300, 600], [0.2, 0.8], 4, 2, seed=1)
    wrong_a, wrong_b = {0, 1, 9}, {1, 2, 9, 15}
    got = passkey.run({"base": FakeLLM(wrong_a), "other": FakeLLM(wrong_b)}, Bytes(), HAY, plan)
    keys = [str(t["key"]) for t in plan]
    assert got["answers"]["base"][0] == "00000" and got["answers"]["base"][3] == keys[3]
    for name, wrong in (("base", wrong_a), ("other", wrong_b)):
        cells = got["cells"][name]
        assert [(c["length"], c["depth"], c["trials"]) for c in cells] == \
            [(300, 0.2, 4), (300, 0.8, 4), (600, 0.2, 4), (600, 0.8, 4)]
        for c, cell in enumerate(cells):
            idx = range(4 * c, 4 * c + 4)
            assert cell["success"] == sum(i not in wrong for i in idx) / 4
            # agreement: both right, or both the same wrong answer
            assert cell["agree"] == sum((i in wrong) == (i in wrong_a) for i in idx) / 4
            assert (cell["low"], cell["high"]) == passkey.wilson(round(4 * cell["success"]), 4)
        pooled = got["lengths"][name]
        assert [(p["length"], p["trials"]) for p in pooled] == [(300, 8), (600, 8)]
        assert pooled[0]["success"] == sum(i not in wrong for i in range(8)) / 8
    assert all(c["agree"] == 1.0 for c in got["cells"]["base"])


def test_prefix_cache_serves_the_haystack_without_changing_answers():
    """Trials sharing an offset hit the prefix cache (one sequence at a time); answers equal an
    LLM's without prefix caching, to the token."""
    loaded = load_model("small-gqa")
    hay = loaded.tokenizer.encode_file(PROSE)
    plan = passkey.plan_trials(len(hay), [320], [0.25, 0.9], 3, 3, seed=2)
    kw = dict(max_num_seqs=1, max_model_len=320 + passkey.ANSWER_TOKENS)
    llms = {"cached": LLM(loaded, **kw), "uncached": LLM(loaded, enable_prefix_caching=False, **kw)}
    got = passkey.run(llms, loaded.tokenizer, hay, plan)
    assert got["answers"]["cached"] == got["answers"]["uncached"]
    assert all(c["agree"] == 1.0 for c in got["cells"]["uncached"])
    assert got["prefix_hit_tokens"]["uncached"] == 0
    # vLLM's rule: a prompt hits the full blocks (16 tokens) it shares from the start with a
    # prompt before it (the pool holds them all here): the instructions always, and the haystack
    # up to the needle for trials of one offset
    prompts = [passkey.prompt_tokens(loaded.tokenizer, hay, t["length"], t["depth"], t["key"], t["offset"])[0]
               for t in plan]

    def common(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    expect = sum(max(common(p, q) for q in prompts[:i]) // 16 * 16 for i, p in enumerate(prompts) if i)
    assert got["prefix_hit_tokens"]["cached"] == expect
    assert expect > sum(2 * t["needle_at"] for t in plan[::3]) * 0.9  # mostly the shared haystacks
