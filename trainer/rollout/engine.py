"""The rollout engine: what ``actor.gen`` samples with, and the plans each engine runs.

Two engines implement ``RolloutEngine``, and ``actor.gen``'s stage holds one
(``trainer/runtime/stages.py``, ``ModelStage.engine``): the built-in generator
(``generator.BuiltinEngine``: the Nereus decoder in ``actor.gen``'s own layout, any tp, pp=1)
and vLLM (``vllm_engine.VLLMEngine``: vLLM's fused q/k/v and gate/up buffers are ``actor.gen``'s
live parameters, over every rank of the world). ``check_rollout_plan`` holds the rules a plan
must meet for its engine, on vLLM's CPU build too; the config check and the environment check
(``trainer/prepare.py``, before any worker starts), the stage builder
(``trainer/runtime/stages.py``), the vLLM engine when it starts (with the head sizes vLLM itself
reports) and the controller's search (``rollout_plan_ok``, over ``actor.gen``'s candidates) ask
it. The vLLM-specific rules it applies live beside vLLM's layout, in ``vllm_layout``:
``check_vllm_plan``, and ``check_vllm_on_cpu`` for what vLLM's CPU build cannot run; whether
vLLM is installed is ``vllm_install.vllm_missing``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from nereus.reshard.derive import DecoderSpec
from nereus.reshard.errors import LayoutError

from ..config import StageConfig
from ..config.names import ACTOR_GEN
if TYPE_CHECKING:  # the plan rules are pure: the controller's search asks them without torch
    from .generator import Rollout


class RolloutEngine(Protocol):
    """Samples responses for one replica's rows; called on every rank of the replica, with
    the same prompts and seed (the draws are keyed by the row, never the rank)."""

    def generate(self, prompts: Sequence[Sequence[int]], *, seed: int, first_row: int, max_new_tokens: int,
                 temperature: float, top_p: float, stop_tokens: Sequence[int], pad_id: int) -> Rollout: ...


def check_rollout_plan(sc: StageConfig, engine: str, *, spec: DecoderSpec | None = None, world: int | None = None,
                       cpu: bool = False, head_dims: Sequence[int] | None = None, model: str = "'model'") -> None:
    """Raise LayoutError unless ``engine`` runs ``actor.gen`` under ``sc``: the built-in
    generator runs unfused pp=1 plans; vLLM runs fused ones (its live parameters are the
    fused buffers) over the whole world of ``world`` ranks (with ``spec``: its TP split of the
    model too); ``cpu``: on vLLM's CPU build, which runs tp=1 and its own head sizes (with
    ``spec``; ``head_dims``: those vLLM reports, else ``vllm_layout.VLLM_CPU_HEAD_DIMS``;
    ``model``: how the message names the model), checked first. The one home of these rules:
    the config check, the stage builder, the vLLM engine and the controller's search
    (``rollout_plan_ok``) ask it."""
    name = f"plan '{ACTOR_GEN}'"
    if engine == "builtin":
        if sc.fused:
            raise LayoutError(f"{name}: fused (vLLM) buffers need rollout.engine: vllm, not the built-in generator")
        if sc.pp > 1:
            raise LayoutError(f"{name}: the built-in generator runs pp=1 only, got pp={sc.pp}")
        return
    if not sc.fused:
        raise LayoutError(f"rollout.engine: vllm writes into vLLM's fused q/k/v and gate/up buffers: set {name} fused: true")
    if cpu:
        from .vllm_layout import VLLM_CPU_HEAD_DIMS, check_vllm_on_cpu

        check_vllm_on_cpu(spec, sc.tp, head_dims=VLLM_CPU_HEAD_DIMS if head_dims is None else head_dims, model=model)
    if spec is not None and world is not None:
        from .vllm_layout import check_vllm_plan  # pure layout rules

        try:
            check_vllm_plan(spec, sc.parallel_config(world), world)
        except LayoutError as e:
            raise LayoutError(f"{name} with rollout.engine: vllm: {e}") from None


def rollout_plan_ok(sc: StageConfig, engine: str, *, spec: DecoderSpec | None = None, world: int | None = None,
                    cpu: bool = False) -> bool:
    """Whether ``check_rollout_plan`` admits ``sc`` (the search's filter of ``actor.gen``'s layouts)."""
    try:
        check_rollout_plan(sc, engine, spec=spec, world=world, cpu=cpu)
    except LayoutError:
        return False
    return True
