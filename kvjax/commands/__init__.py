"""Every `kvjax` subcommand: argument parsing, orchestration and rendering only (the library does the work).

`main` is the entry point (the `kvjax` script); `common` holds what every command shares."""
