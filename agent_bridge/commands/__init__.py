"""`mlx-dspark` subcommands, one module each: `add_parser(subparsers)` and `run(args) -> int`."""


class CommandError(Exception):
    """A user error: printed as one line, exit status 2."""
