"""Metadata store and checkpoints (tensorstore, DCP, safetensors): placeholder, filled by a later issue."""
