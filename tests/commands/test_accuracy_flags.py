"""`kvjax accuracy`'s flags: the suites' defaults for what is left unset, and the passkey and
long-window options as evaluate() receives them."""
import pytest

from kvjax.commands.accuracy import evaluate_kwargs
from kvjax.commands.main import build_parser
from kvjax.errors import UsageError


def kwargs(*argv):
    return evaluate_kwargs(build_parser("accuracy").parse_args(["accuracy", *argv]))


def test_full_suite_defaults():
    kw = kwargs("--model", "smollm2-135m")
    assert kw["passkey_lengths"] == (1024,) and kw["passkey_trials"] == 12 and kw["long_variants"] == "all"
    assert (kw["prompts"], kw["decode_tokens"], kw["long_windows"]) == (8, 128, 1)


def test_basic_suite_has_no_passkey():
    kw = kwargs("--model", "small-gqa")
    assert "passkey_lengths" not in kw and "long_windows" not in kw and "decode_tokens" not in kw


def test_passkey_and_long_flags():
    kw = kwargs("--model", "smollm2-135m", "--passkey-lengths", "512", "4096", "--passkey-depths", "0", "1",
                "--passkey-trials", "3", "--long-variants", "nvfp4", "--decode-tokens", "16")
    assert kw["passkey_lengths"] == (512, 4096) and kw["passkey_depths"] == (0.0, 1.0)
    assert kw["passkey_trials"] == 3 and kw["long_variants"] == ("nvfp4",) and kw["decode_tokens"] == 16
    assert kwargs("--model", "smollm2-135m", "--passkey-lengths", "0")["passkey_lengths"] == ()
    with pytest.raises(UsageError, match="0 \\(off\\) stands alone"):
        kwargs("--model", "smollm2-135m", "--passkey-lengths", "0", "512")
    with pytest.raises(UsageError, match="--passkey-depths.*must be in \\[0, 1\\], got '1.5'"):
        kwargs("--passkey-depths", "1.5")
