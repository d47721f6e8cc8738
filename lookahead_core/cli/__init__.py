"""Command-line entry points: `python -m lookahead_core.cli.demo`, `python -m lookahead_core.cli.profile`."""
