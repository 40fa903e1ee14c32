"""Where prompts and rewards come from.

- ``tasks``      toy verifiable tasks a tiny model learns by RL on CPU (repeat, count), with length curricula
- ``datasets``   prompt datasets as RL users bring them (verl's parquet schema, JSONL, HF ``datasets``) and the seeded sampler
- ``prompts``    a step's prompts and rewards: the toy task's, or a dataset's with its rule or reward function
- ``rewards``    verl's ``compute_score`` contract in worker processes, built-in GSM8K and MATH rules
- ``tokenizer``  a model directory's own tokenizer (``transformers.AutoTokenizer``), EOS and pad ids
"""
