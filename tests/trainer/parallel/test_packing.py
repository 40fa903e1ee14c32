"""Padding-free packing and activation checkpointing on one process: packed rows give the
padded path's log-probs, values, scores, losses and gradients; recomputed blocks give the
same gradients as stored ones, with a lower measured activation peak."""

import pytest
import torch

from nereus.trainer.models.decoder import recompute_layers, set_recompute
from nereus.trainer.parallel.packing import balanced_order, pack_batch, pack_rows, row_spans
from nereus.trainer.runtime.stages import response_logprobs, response_values, sequence_scores

from tests.trainer.models.test_model import make_model

P, N = 5, 7  # prompt width, response columns


def padded_batch(seed: int = 0, rows: int = 6, vocab: int = 64):
    """Rows laid out as a rollout is: prompts left-padded to P, responses right-padded to N,
    with lengths that vary (prompts 2..5, responses 1..7)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (rows, P + N), generator=g)
    mask = torch.zeros(rows, P + N, dtype=torch.bool)
    for i in range(rows):
        plen, rlen = 2 + i % 4, 1 + (3 * i) % N
        mask[i, P - plen : P + rlen] = True
    ids[~mask] = 0
    return {"input_ids": ids, "attention_mask": mask, "prompt_width": torch.full((rows,), P), "response_mask": mask[:, P:]}


def test_pack_rows_is_first_fit_decreasing_and_never_splits_a_row():
    assert pack_rows([5, 3, 8, 2, 7], 10) == [[2, 3], [1, 4], [0]]
    assert pack_rows([4, 4, 4], 12) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="row 1 of the share holds 9 tokens, more than micro_batch_tokens=8"):
        pack_rows([3, 9], 8)


def test_pack_rows_splits_to_a_given_count_within_the_budget():
    assert len(pack_rows([9] * 6, 17)) == 6 and len(pack_rows([9, 9, 9, 9, 8, 9], 17)) == 5  # two FSDP replicas' shares
    for count in range(3, 7):
        packs = pack_rows([5, 3, 8, 2, 7, 1], 10, count)
        assert len(packs) == count and sorted(i for p in packs for i in p) == list(range(6))
        assert all(sum([5, 3, 8, 2, 7, 1][i] for i in p) <= 10 for p in packs)
    with pytest.raises(ValueError, match="7 packs asked of 6 rows"):
        pack_rows([5, 3, 8, 2, 7, 1], 10, 7)


def test_a_row_without_a_prompt_token_is_refused():
    batch = padded_batch()
    batch["attention_mask"][0, : P] = False
    with pytest.raises(ValueError, match="row 0 has no prompt token before column 5"):
        pack_batch(batch, 64)


def test_balanced_order_deals_equal_rows_with_balanced_tokens():
    lengths = [50, 1, 1, 1, 40, 45, 2, 60]
    order = balanced_order(lengths, 2)
    assert sorted(order) == list(range(8))
    halves = [sum(lengths[i] for i in order[:4]), sum(lengths[i] for i in order[4:])]
    contiguous = [sum(lengths[:4]), sum(lengths[4:])]
    assert abs(halves[0] - halves[1]) <= 10 < abs(contiguous[0] - contiguous[1])
    assert balanced_order(lengths, 3) == list(range(8))  # unequal shares: left as they are


def test_row_spans_refuse_a_pad_inside_a_row():
    mask = torch.tensor([[0, 1, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    with pytest.raises(ValueError, match="row 1: its real tokens are not contiguous"):
        row_spans(mask)


@pytest.mark.parametrize("budget", [12, 20, 64])
def test_packed_forward_equals_the_padded_one_row_for_row(budget):
    model = make_model(std=0.1, dtype="float64")
    batch = padded_batch()
    with torch.no_grad():
        padded = model(batch["input_ids"], attention_mask=batch["attention_mask"])
        packing = pack_batch(batch, budget)
        assert all(sum(int(batch["attention_mask"][i].sum()) for i in pack) <= budget for pack in packing.packs)
        packed = [model(**_inputs(packing, m)) for m in range(len(packing.packs))]
    ref_lp, _ = response_logprobs(padded, batch, 0.7)
    mask = batch["response_mask"]
    for m, out in enumerate(packed):
        mb = packing.rows_of(batch, m)
        lp, _ = response_logprobs(out, mb, 0.7)
        rows = torch.tensor(packing.packs[m])
        torch.testing.assert_close(lp[mask[rows]], ref_lp[rows][mask[rows]], rtol=0, atol=1e-12)
    # unpack: per-position values of all packs back to rows (values at the scoring window, scores at the last token)
    values = torch.stack([torch.nn.functional.pad(o[0, :, 0], (0, packing.width - o.shape[1])) for o in packed])
    ref_scores = sequence_scores(padded[..., 0], batch)
    torch.testing.assert_close(packing.unpack(values, at="last"), ref_scores, rtol=0, atol=1e-12)
    ref_values = response_values(padded[..., 0], batch)
    torch.testing.assert_close(packing.unpack(values, at="score")[mask], ref_values[mask], rtol=0, atol=1e-12)


def test_packed_log_probs_equal_the_padded_ones_in_float32():
    model = make_model(std=0.1)
    batch = padded_batch(seed=4, rows=8)
    mask = batch["response_mask"]
    with torch.no_grad():
        ref, _ = response_logprobs(model(batch["input_ids"], attention_mask=batch["attention_mask"]), batch, 1.0)
        packing = pack_batch(batch, 24)
        for m in range(len(packing.packs)):
            mb = packing.rows_of(batch, m)
            lp, _ = response_logprobs(model(**_inputs(packing, m)), mb, 1.0)
            rows = torch.tensor(packing.packs[m])
            torch.testing.assert_close(lp[mask[rows]], ref[rows][mask[rows]], rtol=0, atol=2e-6)
            assert (lp[~mask[rows]] == 0).all()  # padding: nothing computed


def _inputs(packing, m):
    inputs = packing.model_inputs(m)
    return {"input_ids": inputs.pop("input_ids"), **inputs}


def test_packed_loss_gives_the_padded_gradients():
    batch = padded_batch(seed=1)
    mask = batch["response_mask"]

    def loss_of(lp, rows_mask):
        return (lp * rows_mask).sum() / mask.sum()

    ref = make_model(std=0.1, dtype="float64")
    lp, _ = response_logprobs(ref(batch["input_ids"], attention_mask=batch["attention_mask"]), batch, 1.0)
    loss_of(lp, mask).backward()
    model = make_model(std=0.1, dtype="float64")
    packing = pack_batch(batch, 16)
    assert len(packing.packs) > 1
    for m in range(len(packing.packs)):
        mb = packing.rows_of(batch, m)
        lp, _ = response_logprobs(model(**_inputs(packing, m)), mb, 1.0)
        loss_of(lp, mb["response_mask"]).backward()
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_recompute_layers_by_mode():
    names = [str(i) for i in range(5)]
    assert recompute_layers("full", names) == set(names)
    assert recompute_layers("selective", names) == {"0", "2", "4"}
    assert recompute_layers("none", names) == set()
    with pytest.raises(ValueError, match="recompute='some' is not one of none, full, selective"):
        recompute_layers("some", names)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_gives_the_same_gradients(mode):
    batch = padded_batch(seed=2)
    grads = {}
    for m in ("none", mode):
        model = make_model(std=0.1, num_layers=4)
        set_recompute(model, m)
        out = model(batch["input_ids"], attention_mask=batch["attention_mask"])
        out.float().logsumexp(-1).sum().backward()
        grads[m] = [p.grad.clone() for p in model.parameters()]
    for a, b in zip(grads["none"], grads[mode]):
        assert torch.equal(a, b)  # the same kernels on the same inputs: bit for bit


def test_recompute_lowers_the_measured_activation_peak():
    """Bytes saved for backward, counted by autograd's saved-tensor hooks: full recompute
    keeps each block's input only."""
    batch = padded_batch(seed=3, rows=16)
    saved = {}
    for mode in ("none", "full"):
        model = make_model(std=0.1, num_layers=4)
        set_recompute(model, mode)
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(batch["input_ids"], attention_mask=batch["attention_mask"])
        saved[mode] = total[0]
        out.sum().backward()
    assert saved["full"] < 0.5 * saved["none"], saved


@pytest.mark.timeout(600)
def test_the_trainer_recomputes_with_a_lower_measured_peak_and_the_same_update(tmp_path):
    """Through ``nereus train``'s own step (FSDP2 over dp2, 4 layers, 40-token responses):
    actor.train's measured activation peak (tensor bytes its forward and backward allocate,
    ``StageMeter(tensors=...)``) falls with recompute, and the update stays bit for bit."""
    from nereus.trainer.prepare import load_config
    from nereus.trainer.runtime.layout_check import compare, run_layouts

    cfg = load_config("configs/tiny_grpo.yaml", [
        f"run_dir={tmp_path}", "checkpoint_every=0", "nproc=2", "rollout.prompts_per_step=8", "grpo.minibatch_size=32",
        "rollout.max_new_tokens=40", "rollout.ignore_eos=true", "model.max_seq_len=45", "model.num_layers=4",
        "plan.actor.train.dp=2", "plan.actor.gen.dp=2", "plan.actor.gen.tp=1", "plan.ref.infer.dp=2", "plan.ref.infer.tp=1",
    ])
    modes = ("none", "selective", "full")
    results = run_layouts(cfg, [[f"plan.actor.train.recompute={m}"] for m in modes], steps=2, tensor_peaks=("actor.train",))
    peak = {m: r.stage_peaks["actor.train"] for m, r in zip(modes, results)}
    assert peak["full"] < peak["selective"] < peak["none"], peak
    assert peak["full"] < 0.6 * peak["none"], peak
    for plan, worst in compare(results).items():
        for kind, (err, where) in worst.items():
            assert err == 0.0, f"{plan}: {kind} differs by {err:.2e} at {where}"


def test_a_packs_loss_holds_logits_of_its_real_tokens_only():
    """Many short rows in a wide batch: the bytes autograd keeps for the packed loss follow
    the real tokens, not rows × the padded response width × vocabulary."""
    model = make_model(std=0.1, vocab_size=512)
    rows, width = 16, 40
    ids = torch.randint(1, 512, (rows, P + width), generator=torch.Generator().manual_seed(5))
    mask = torch.zeros(rows, P + width, dtype=torch.bool)
    mask[:, P - 2 : P + 2] = True  # 2-token prompts, 2-token responses...
    mask[0, P - 2 :] = True  # ...but one row is as long as the batch is wide
    batch = {"input_ids": ids, "attention_mask": mask, "prompt_width": torch.full((rows,), P), "response_mask": mask[:, P:]}

    def saved_bytes(fn) -> int:
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return total[0]

    padded = saved_bytes(lambda: response_logprobs(model(ids, attention_mask=mask), batch, 0.7))
    packing = pack_batch(batch, 128)
    assert len(packing.packs) == 1
    mb = packing.rows_of(batch, 0)
    packed = saved_bytes(lambda: response_logprobs(model(**_inputs(packing, 0)), mb, 0.7))
    assert packed < 0.4 * padded, (packed, padded)
