"""Tests of nereus.trainer (model, generation)."""
