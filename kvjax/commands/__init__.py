"""`kvjax` subcommands that run models. Part of the command line: unlike the library core, these
modules import both `kvjax` and `models`. Each has add_parser(subparsers) and run(args) -> int."""
