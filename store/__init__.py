"""The store: checkpoints and the job's records on any fsspec path.

- ``kv``             the metadata store: versioned JSON records on tensorstore (OCDBT), compare-and-swap
- ``records``        its records: checkpoint manifests, plans, the job record (pure data)
- ``job``            the job record and plan history, updated by compare-and-swap
- ``checkpoint``     sharded checkpoints, saved by any layout and loaded into any other, on any number of ranks
- ``dcp_io``         checkpoint data written through torch.distributed.checkpoint, in the staged box format
- ``async_save``     a checkpoint staged to host memory, then written and committed in the background
- ``hf``             HuggingFace directories (``config.json`` and safetensors), checked against the decoder
- ``safetensors_io`` the safetensors format, read and written a tensor (or a box of one) at a time
- ``convert``        offline conversion between HF safetensors and Nereus checkpoints in any layout
- ``inspect``        views of a checkpoint root for ``nereus inspect``: checkpoints, a manifest, the job record
- ``checksum``       block checksums of checkpoint files: CRC32C, and the legacy ``wsum64``
- ``errors``         ``StoreError`` and its kinds, each naming the key, file or tensor at fault
"""
