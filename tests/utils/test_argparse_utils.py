"""FlexibleArgumentParser (vLLM's `vllm/utils/argparse_utils.py`): each rewrite of the command
line against a hand-written Namespace, and argparse's own errors left as argparse makes them."""
import argparse
import json
import warnings

import pytest

from kvjax.errors import UsageError
from kvjax.utils import FlexibleArgumentParser
from kvjax.utils.argparse_utils import human_readable_int, human_readable_int_or_auto


def _parser() -> FlexibleArgumentParser:
    """A small EngineArgs-like parser: dashed names, a JSON option, a paired boolean, a group."""
    p = FlexibleArgumentParser(prog="demo", description="A demo.")
    p.add_argument("--model", default="small-gqa")
    p.add_argument("--max-num-seqs", type=int, default=8, help="Rows per step.")
    p.add_argument("--kv-transfer-config", type=json.loads, default=None)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="Reuse cached blocks.")
    p.add_argument("--optimization-level", default="2")
    p.add_argument("--stop", nargs="+")
    p.add_argument("--swap-space", type=int, default=0, deprecated=True)
    group = p.add_argument_group("Sampling", "Sampling parameters.\n\nThe second paragraph.")
    group.add_argument("--temperature", type=float, default=1.0)
    group.add_argument("--top-p", type=float, default=1.0)
    return p


def _parse(*args):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of these command lines warns
        return vars(_parser().parse_args(list(args)))


def test_underscores_in_option_names_are_dashes_and_values_are_kept():
    args = _parse("--max_num_seqs", "4", "--top_p=0.5", "--model", "my_model", "--kv_transfer_config={\"a_b\": 1}")
    assert args["max_num_seqs"] == 4 and args["top_p"] == 0.5
    assert args["model"] == "my_model"  # a value's underscores stay
    assert args["kv_transfer_config"] == {"a_b": 1}
    assert _parse("--model=a_b.c")["model"] == "a_b.c"  # a "." in a value is not a dotted option


def test_dotted_options_build_one_json_value():
    args = _parse("--kv_transfer_config.kv_connector_extra_config.eviction_policy", "arc",
                  "--kv-transfer-config.kv_connector_extra_config.size=80g",
                  "--kv-transfer-config.n", "3", "--kv-transfer-config.on", "true",
                  "--kv-transfer-config.ids+", "1", "--kv-transfer-config.ids+=2,3")
    assert args["kv_transfer_config"] == {
        "kv_connector_extra_config": {"eviction_policy": "arc", "size": 80 * 10**9},  # keys keep "_"
        "n": 3, "on": True, "ids": ["1", "2", "3"]}  # JSON, human-readable ints, "+" lists of strings


def test_a_key_or_an_option_given_twice_warns():
    with pytest.warns(UserWarning, match=r"Found duplicate keys --kv-transfer-config\.a$"):
        args = _parser().parse_args(["--kv-transfer-config.a", "1", "--kv-transfer-config.a", "2"])
    assert args.kv_transfer_config == {"a": 2}
    with pytest.warns(UserWarning, match="Found duplicate keys --max-num-seqs"):
        assert _parser().parse_args(["--max-num-seqs", "1", "--max_num_seqs=2"]).max_num_seqs == 2


def test_negative_decimal_values_stay_values():
    # vLLM would read "-0.5" as a dotted option "-0" with key "5".
    assert _parse("--temperature", "-0.5")["temperature"] == -0.5


@pytest.mark.parametrize("argv, level", [(["-O3"], "3"), (["-O=1"], "1"), (["-O", "0"], "0"),
                                         (["-Odecode"], "decode"), ([], "2")])
def test_O_shortcuts_set_the_optimization_level(argv, level):
    assert _parse(*argv)["optimization_level"] == level


def test_boolean_options_pair_enable_with_disable():
    assert _parse()["enable_prefix_caching"] is True
    assert _parse("--disable-prefix-caching")["enable_prefix_caching"] is False
    assert _parse("--disable_prefix_caching", "--enable-prefix-caching")["enable_prefix_caching"] is True
    assert _parse("--no-enable-prefix-caching")["enable_prefix_caching"] is False  # still accepted
    p = _parser()
    p._search_keyword = "all"
    text = p.format_help()
    assert "--enable-prefix-caching, --disable-prefix-caching" in text and "--no-enable" not in text


def test_a_deprecated_option_warns_only_when_given():
    with pytest.warns(FutureWarning, match="argument 'swap_space' is deprecated"):
        assert _parser().parse_args(["--swap-space", "4"]).swap_space == 4
    assert _parse()["swap_space"] == 0  # no warning (_parse turns warnings into errors)


def test_config_file_sits_between_the_defaults_and_the_command_line(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max_num_seqs: 4\nenable-prefix-caching: false\nstop: [a, b]\ntemperature: 0.5\n"
                   "kv-transfer-config:\n  kv_connector_extra_config: {eviction_policy: arc}\n")
    p = _parser()
    assert p.load_config_file(str(cfg)) == [
        "--max_num_seqs", "4", "--no-enable-prefix-caching", "--stop", "a", "b", "--temperature", "0.5",
        "--kv-transfer-config", '{"kv_connector_extra_config": {"eviction_policy": "arc"}}']
    with pytest.warns(UserWarning, match="duplicate keys --temperature"):  # the command line wins, as in vLLM
        args = p.parse_args(["--config", str(cfg), "--temperature", "0.1"])
    assert (args.max_num_seqs, args.enable_prefix_caching, args.stop, args.temperature) == (4, False, ["a", "b"], 0.1)
    assert args.kv_transfer_config == {"kv_connector_extra_config": {"eviction_policy": "arc"}}
    # A first argument that is no option is a sub-command: the file's arguments go after it.
    assert p._pull_args_from_config(["run", "--model", "x", "--config", str(cfg)])[:3] == ["run", "--max_num_seqs", "4"]


def test_config_file_errors(tmp_path):
    with pytest.raises(UsageError, match="must be of a yaml/yml type. json supplied"):
        _parser().parse_args(["--config", str(tmp_path / "c.json")])
    with pytest.raises(UsageError, match="More than one config file"):
        _parser().parse_args(["--config", "a.yaml", "--config", "b.yaml"])
    with pytest.raises(UsageError, match="No config file specified"):
        _parser().parse_args(["--config"])
    with pytest.raises(UsageError, match="Unable to read the config file"):
        _parser().parse_args(["--config", str(tmp_path / "missing.yaml")])


def test_help_lists_groups_and_help_keyword_searches(capsys):
    def help_text(*argv):
        with pytest.raises(SystemExit) as exit_:
            _parser().parse_args(list(argv))
        assert exit_.value.code == 0
        return capsys.readouterr().out

    top = help_text("--help")
    assert "Config Groups:" in top and "Sampling Sampling parameters." in top and "--top-p TOP_P\n" not in top
    group = help_text("--help=sampling")
    assert "--temperature" in group and "--top-p" in group and "--max-num-seqs" not in group
    words = help_text("--help=max_num")  # underscores searched as dashes
    assert "Arguments matching 'max-num'" in words and "Rows per step. (default: 8)" in words
    assert "No group or arguments matching 'nothing'" in help_text("--help=nothing")
    every = help_text("--help=all")
    assert "--max-num-seqs" in every and "--top-p" in every and "--json-arg.key1 value1" in every
    options = every[every.index("options:"):]
    assert options.index("--enable-prefix-caching") < options.index("--max-num-seqs")  # sorted by name


@pytest.mark.parametrize("argv, message", [
    (["--bogus", "1"], "demo: error: unrecognized arguments: --bogus 1"),
    (["--max_num_seqs", "x"], "demo: error: argument --max-num-seqs: invalid int value: 'x'"),
])
def test_argparse_errors_exit_2_with_argparse_message(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: demo") and err.rstrip().endswith(message)


@pytest.mark.parametrize("text, value", [("1k", 1000), ("1K", 1024), ("25.6k", 25600), ("2M", 2 * 2**20),
                                         ("3g", 3 * 10**9), (" 42 ", 42)])
def test_human_readable_int(text, value):
    assert human_readable_int(text) == value


def test_human_readable_int_refusals_and_auto():
    with pytest.raises(argparse.ArgumentTypeError, match="did you mean 1.5k"):
        human_readable_int("1.5K")
    with pytest.raises(ValueError):
        human_readable_int("ten")
    assert human_readable_int_or_auto("auto") == human_readable_int_or_auto("-1") == -1
    assert human_readable_int_or_auto("2k") == 2000
