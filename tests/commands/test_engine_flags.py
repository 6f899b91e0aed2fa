"""Every `kvjax` command takes its engine flags from the one table (kvjax.engine.cli_args.FLAGS,
vLLM's EngineArgs.add_cli_args): a flag that shares an option string with the table is one that
add_engine_flags made, with the table's names, dest and parsing; a command changes only its
default and help, or (listed here, with why) its type. And the defaults users see are as before."""
from __future__ import annotations

import argparse

import pytest

from kvjax.commands.main import _MODULE_COMMANDS, build_parser
from kvjax.engine.cli_args import FLAGS, add_engine_flags

# field of every option string in the table: "--block-size" → "block_size", "-tp" → "tensor_parallel_size"
TABLE_OPTIONS = {flag: field for field, (flags, _) in FLAGS.items() for flag in flags}
# Commands that read a flag's value their own way (add_engine_flags' `types`): memory and plan read the memory
# sizes as exact decimals (kvjax.accounting.budget); plan's -tp counts ranks beyond the engine's 256 devices.
TYPE_OVERRIDES = {"memory": {"gpu_memory_utilization", "total_memory_bytes"},
                  "plan": {"gpu_memory_utilization", "total_memory_bytes", "kv_offloading_size",
                           "tensor_parallel_size"}}
TYPE_OVERRIDES["simulate"] = TYPE_OVERRIDES["plan"]  # plan's sizing flags, read by plan's code


def _command_parser(command: str) -> argparse.ArgumentParser:
    """The parser of one subcommand, built as `kvjax COMMAND` builds it."""
    sub = next(a for a in build_parser(command)._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _hand_made(parser: argparse.ArgumentParser, type_overrides=frozenset()) -> list[str]:
    """The engine flags of parser that add_engine_flags did not make as the table says."""
    bad = []
    for action in parser._actions:
        fields = {TABLE_OPTIONS[s] for s in action.option_strings if s in TABLE_OPTIONS}
        if not fields:
            continue
        field = getattr(action, "engine_field", None)
        flags, kwargs = FLAGS[field] if field in FLAGS else ((), {})
        if kwargs.get("action") is argparse.BooleanOptionalAction:  # --x and --no-x
            flags += tuple("--no-" + f[2:] for f in flags)
        same = (fields == {field} and tuple(action.option_strings) == flags and action.dest == field
                and all(getattr(action, key) == kwargs[key] for key in ("choices", "metavar", "nargs") if key in kwargs)
                and (field in type_overrides or action.type is kwargs.get("type")))
        if not same:
            bad.append("/".join(action.option_strings))
    return bad


@pytest.mark.parametrize("command", sorted(_MODULE_COMMANDS))
def test_every_engine_flag_comes_from_the_table(command):
    parser = _command_parser(command)
    assert _hand_made(parser, TYPE_OVERRIDES.get(command, frozenset())) == []
    parser.format_help()  # every help line renders


def test_a_flag_defined_by_hand_is_caught():
    parser = argparse.ArgumentParser()
    add_engine_flags(parser, ["kv_cache_dtype", "tensor_parallel_size"])
    assert _hand_made(parser) == []
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=FLAGS["max_num_seqs"][1]["type"])  # the table's type, but by hand
    assert _hand_made(parser) == ["--block-size", "--max-num-seqs"]
    typed = argparse.ArgumentParser()
    add_engine_flags(typed, ["gpu_memory_utilization"], types={"gpu_memory_utilization": str})
    assert _hand_made(typed) == ["--gpu-memory-utilization"] and _hand_made(typed, {"gpu_memory_utilization"}) == []


def test_overrides_name_added_flags_and_leave_the_table_alone():
    with pytest.raises(KeyError, match="overrides for flags not added"):
        add_engine_flags(argparse.ArgumentParser(), ["block_size"], defaults={"max_num_seqs": 256})
    with pytest.raises(KeyError, match="no engine flag"):
        add_engine_flags(argparse.ArgumentParser(), ["block_sizes"])
    _command_parser("memory")
    assert FLAGS["block_size"][1]["default"] == 16 and FLAGS["max_num_seqs"][1]["default"] == 8


def _defaults(*argv: str) -> argparse.Namespace:
    return build_parser(argv[0]).parse_args(list(argv))


def test_user_visible_defaults_are_as_before():
    memory = _defaults("memory", "--model", "small-gqa")
    assert (memory.block_size, memory.max_num_seqs, memory.max_num_batched_tokens) == (64, 256, 2048)
    assert (memory.tensor_parallel_size, memory.seed, memory.kv_cache_dtype) == (1, 0, "auto")
    assert memory.max_model_len is None
    assert (memory.gpu_memory_utilization, memory.total_memory_bytes, memory.dtype) == (None, None, "auto")
    decode = _defaults("decode", "--model", "small-gqa", "--synthetic", "1")
    assert (decode.block_size, decode.max_num_seqs, decode.max_num_batched_tokens) == (16, 8, None)
    plan = _defaults("plan", "--group", "A")  # unset: the group's value (None), block 64
    assert (plan.block_size, plan.tensor_parallel_size, plan.kv_cache_dtype) == (64, None, None)
    assert _defaults("accuracy").model == "small-gqa"
    for command in ("memory", "decode", "calibrate"):
        assert _command_parser(command)._option_string_actions["--model"].required, command


def test_memory_and_plan_keep_the_memory_sizes_as_typed():
    # exact decimals, read by kvjax.accounting.budget (ceil(total × U) to the byte), not floats
    args = _defaults("memory", "--model", "small-gqa", "--device-memory-gib", "0.004",
                     "--gpu-memory-utilization", "0.9")
    assert (args.total_memory_bytes, args.gpu_memory_utilization) == ("0.004", "0.9")
    args = _defaults("plan", "--group", "A", "--kv-offloading-size", "10.5", "-tp", "512")
    assert (args.kv_offloading_size, args.tensor_parallel_size) == ("10.5", 512)
