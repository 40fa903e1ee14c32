"""The models, with no parallelism inside.

- ``decoder``  a Llama/Qwen2-family decoder in plain PyTorch, HF parameter names, LM or value head
- ``args``     each model-stage's model arguments, from the job config's shapes
"""
