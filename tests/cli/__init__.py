"""Tests of nereus.cli (commands run through Typer's CliRunner)."""
