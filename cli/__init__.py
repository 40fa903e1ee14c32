"""Command-line interface (Typer); thin wrappers over library code."""
