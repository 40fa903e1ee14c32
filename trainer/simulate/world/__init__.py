"""The world: ``nereus simulate``'s ground truth, a model of its own that the controller must learn.

- ``params``    the hardware and software parameters (``configs/simulate/worlds/<kind>.yaml``), checked key by key
- ``shapes``    a model-stage's shapes, a step's lengths as arrays, the response-length distribution
- ``kernels``   a roofline per kernel: shape-dependent GEMM efficiency, fused attention, streaming ops
- ``links``     placement of TP/PP/DP groups on nodes; hierarchical α–β collectives with NIC contention
- ``stages``    training and inference stages: micro-batches, 1F1B pipeline, DP/FSDP, AdamW
- ``generate``  the rollout: prefill, then a shrinking batch decoding against its KV cache
- ``memory``    every rank's peak, co-resident state, hidden allocator slack per layout class
- ``movement``  weight syncs and transitions on the world's links
- ``noise``     counter-based draws: device speeds, stragglers, per-step noise
- ``world``     ``World``: a step's pieces and peaks, out of memory, a transition (what ``policies``/``baselines`` ask), plus ``expected_trace`` over a trace

It imports nothing of ``trainer/controller`` nor ``policies``/``baselines`` (a test holds that
boundary); docs/world.md lists every parameter, its source, and what the world leaves out.
"""

from .params import WorldError, WorldParams, load_world_params
from .shapes import Lengths, Work
from .world import World, pieces

__all__ = ["Lengths", "Work", "World", "WorldError", "WorldParams", "load_world_params", "pieces"]
