"""The store: tensorstore metadata store (``kv``, ``records``, ``job``), sharded checkpoints
written through DCP in the staged box format (``checkpoint``, ``dcp_io``; in the background: ``async_save``), HF safetensors
import/export (``hf``, ``safetensors_io``) and offline conversion (``convert``)."""
