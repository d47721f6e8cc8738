"""Command-line entry points: `python -m lookahead_core.cli.demo`."""
