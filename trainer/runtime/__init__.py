"""The job at run time, on every rank.

- ``step``          ``Trainer``: one step, generation -> inference -> training, each model-stage in its layout
- ``stages``        model-stages built in their layouts, and run on their share of the batch
- ``transition``    the per-step weight syncs and ``apply_plan``: state streamed between layouts through reshard
- ``checkpoint``    save, restore and stage the trained state; HF checkpoints loaded through memory maps
- ``lr_schedule``   the LR as a pure function of the optimizer step, attached at its AdamW count
- ``control``       ``JobControl``: the controller's seam (rank 0 decides, every rank applies)
- ``worker``        one rank of ``nereus train``: start or restore, then the step loop over its components
- ``layout_check``  the same steps under several plans, compared (layout invariance)
"""
