"""A job's checkpoints and staged copies: what the trained stages save, and how they load.

- ``save(trainer)``: the training stages' weights and AdamW state, committed through the store
  atomically (``nereus.store.checkpoint``), with each model's HF config and side files so
  that ``nereus convert RUN_DIR/checkpoints OUT --to hf`` exports it; a failed step never
  touches it;
- ``job_state(trainer)``: the JSON-able state a checkpoint or a staged copy carries besides
  the tensors (step, prompt sampler, LR schedules, the controller's, the plan record);
- ``stage(trainer, stager)``: the step's state into node memory (``trainer/elastic/staging.py``);
- ``restore(trainer, root, step)``: a committed checkpoint into this rank's layouts, any layout;
- ``load_hf``: a HuggingFace checkpoint into a stage, read through memory maps.

``trainer`` is a ``runtime.step.Trainer``: these run on every rank, collectively.
"""

from __future__ import annotations

import os
from dataclasses import replace

from ..config import config_to_dict
from ..config.names import ACTOR, model_of
from ..models.decoder import ModelArgs, init_tensor
from ..parallel.parallelize import load_full
from . import lr_schedule
from .stages import ModelStage

KEEP_CHECKPOINTS = 3


def checkpoint_root(trainer) -> str:
    return os.path.join(trainer.cfg.run_dir, "checkpoints")


def save(trainer) -> None:
    """Commit the training stages' weights and AdamW state (every rank calls it)."""
    from nereus.store.checkpoint import save_checkpoint
    from nereus.store.convert import one_dtype
    from nereus.store.hf import HFCheckpoint, side_files

    emus = [e for s in trainer.trained_stages() for e in s.emus]
    buffers = {model_of(s.key): s.buffers() for s in trainer.trained_stages()}
    # each model's HF config (as trained: its head, its shapes; the rest of its source's
    # config.json) and, on the coordinator, its source's side files: `nereus convert
    # RUN_DIR/checkpoints OUT --to hf --model actor` exports what this saves
    configs, files = {}, {}
    for s in trainer.trained_stages():
        model, source = model_of(s.key), trainer.cfg.stage_model(s.key)[1]
        original = HFCheckpoint.open(source.path).config if source.path else {}
        dtype = next(t.dtype for e in s.emus for t in e.tensors if not t.name.startswith("optim/"))
        hf = s.args.to_hf_config()
        if "max_position_embeddings" in original:  # the model's own limit, not this job's max_seq_len
            hf["max_position_embeddings"] = original["max_position_embeddings"]
        configs[model] = one_dtype({**original, **hf}, dtype)  # the masters' dtype
        if source.path and trainer.rank == 0:
            files.update({f"hf/{model}/{name}": data for name, data in side_files(source.path).items()})
        if model == ACTOR and trainer.cfg.tokenizer.path and trainer.rank == 0:  # the tokenizer the job used
            files.update({f"hf/{model}/{name}": data for name, data in side_files(trainer.cfg.tokenizer.path).items()
                          if name != "generation_config.json"})
    state = {**job_state(trainer), "hf_configs": configs}
    save_checkpoint(checkpoint_root(trainer), trainer.step, emus, buffers, rank=trainer.rank, state=state, files=files,
                    plan=config_to_dict(trainer.cfg.plan), keep=KEEP_CHECKPOINTS)  # --resume restarts in this plan


def job_state(trainer) -> dict:
    """The JSON-able state a checkpoint or a staged copy carries besides the tensors: the
    step, the prompt sampler's position, the LR schedules' positions, the controller's,
    the run's lineage and its plan record (``trainer/elastic/staging.py``: advanced here when the
    plan differs from the one the last record was written in)."""
    from ..elastic.staging import advance_plan_record

    trainer.extra_state["data"] = trainer.source.state_dict()  # the prompt sampler's position
    for key, provide in trainer.state_providers.items():
        trainer.extra_state[key] = provide()
    trainer.extra_state["plan_record"] = advance_plan_record(trainer.extra_state.get("plan_record"),
                                                             config_to_dict(trainer.cfg.plan), trainer.step)
    return {"step": trainer.step, **trainer.extra_state}


def stage(trainer, stager) -> None:
    """Stage this step's state in node memory (``trainer/elastic/staging.py``; every rank calls it)."""
    from ..elastic.staging import staged_state

    plan = config_to_dict(trainer.cfg.plan)
    buffers = {model_of(s.key): s.buffers() for s in trainer.trained_stages()}
    state = job_state(trainer)
    stager.stage(trainer.step, [e for s in trainer.trained_stages() for e in s.emus], buffers,
                 {**state, **staged_state(trainer.cfg.run_dir, state.get("lineage"))}, plan)


def restore(trainer, root: str | None = None, *, step: int | None = None) -> int:
    """Load the committed checkpoint of ``step`` (default: the latest) under ``root``
    (default: the run's durable checkpoints; a staged copy's root) into this rank's
    layouts; returns its step."""
    from nereus.store.checkpoint import CheckpointStore, load_checkpoint

    root = root or checkpoint_root(trainer)
    if not CheckpointStore(root).steps():
        raise FileNotFoundError(f"--resume: no committed checkpoint under {root}")
    emus = [e for s in trainer.trained_stages() for e in s.emus]
    buffers = {model_of(s.key): s.buffers() for s in trainer.trained_stages()}
    manifest, _ = load_checkpoint(root, emus, trainer.rank, buffers, step=step)
    trainer.step = manifest.step
    trainer.restored_state = dict(manifest.state or {})
    trainer.source.load_state_dict(trainer.restored_state.get("data", {}))
    for stage in trainer.trained_stages():  # AdamW's step came back with its state: the schedule resumes from it
        trainer.attach_schedule(stage.key, stage)
        saved = trainer.restored_state.get("lr_schedule", {}).get(model_of(stage.key))
        if saved and stage.optimizer is not None and saved["optimizer_steps"] != lr_schedule.optimizer_step_count(stage.optimizer):
            raise RuntimeError(f"checkpoint of step {trainer.step}: {stage.key}'s optimizer restored at update "
                               f"{lr_schedule.optimizer_step_count(stage.optimizer)}, but it was saved at {saved['optimizer_steps']}")
    if trainer.rank == 0:  # this job owns the root and is not saving: unfinished saves of its last run go
        CheckpointStore(root).clean_orphans(older_than=0)
    return trainer.step


def load_hf(stage: ModelStage, path: str, *, fresh_head: tuple[int, float] | None = None) -> None:
    """This rank's boxes of a HuggingFace checkpoint, read through memory maps: only the
    pages of the boxes are touched, and ``copy_`` casts them to the stage's dtype.

    ``fresh_head=(seed, std)``: ``path`` is the causal LM a value model is built on (a critic
    that shares the actor's ``model``, started as verl and OpenRLHF start one): the backbone
    comes from the checkpoint, its ``lm_head`` is not read, and ``score.weight`` is drawn as
    ``init_stage`` draws it."""
    from nereus.store.hf import HFCheckpoint, check_against_spec

    ckpt = HFCheckpoint.open(path)
    spec = stage.args.spec
    check_against_spec(ckpt, replace(spec, head="lm") if fresh_head else spec)
    check_forward_settings(stage.args, ckpt.config, path)
    if fresh_head is None:
        load_full(stage.part, ckpt.mapped)
        return
    seed, std = fresh_head
    shapes = {t.name: t.shape for t in stage.part.layouts()}
    load_full(stage.part, lambda name: init_tensor(name, shapes[name], seed, std) if name == "score.weight" else ckpt.mapped(name))


def check_forward_settings(args: ModelArgs, config: dict, path: str) -> None:
    """What the config's ``model`` says about the forward (RoPE base and scaling, RMSNorm eps)
    must be what the checkpoint was trained with: a mismatch computes silently wrong outputs."""
    hf = ModelArgs.from_hf_config(config)
    for key in ("rope_theta", "rope_scaling", "rms_norm_eps"):
        ours, theirs = getattr(args, key), getattr(hf, key)
        if ours != theirs:
            raise ValueError(f"model.{key} is {ours!r}, but {path}/config.json has {theirs!r}: set it to match")
