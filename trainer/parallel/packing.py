"""Token-budget micro-batches: rows packed, padding removed, into sequences of real tokens (pure).

A rollout batch is padded: row i is ``[pad… prompt_i | response_i …pad]`` (prompts
left-padded to ``prompt_width`` P, responses right-padded), so its real tokens are one
contiguous span ``[s_i, e_i)``. With ``micro_batch_tokens`` (verl's
``ppo_max_token_len_per_gpu``) a replica's rows are packed into *packs*: each pack is one
sequence holding the real spans of a few rows back to back, at most ``budget`` tokens, and
one pack is one micro-batch. The model sees a pack as one row with the positions restarting
at 0 at each row's first token and a document mask (a token attends to the earlier tokens
of its own row only, ``model.document_mask``), so every row's outputs are those of the
padded forward, up to floating-point rounding, while the linear layers run on real tokens
only: on a batch whose lengths vary 10×, about half the padded work.

Everything downstream reads the padded layout: ``Packing`` maps each row's window of
response-scoring positions (padded positions P-1 … T-2, ``stages.response_logprobs``) and
its last real token to positions in its pack, so a loss or an output function gathers
``[rows, N]`` from a pack's output exactly where the padded path slices it.

Rows are packed first-fit decreasing (the longest first; packs in the order they open) and,
before that, dealt to dp replicas in equal numbers balanced by token count (longest first,
each to the replica with the fewest tokens that still has room), the same on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch


def row_spans(attention_mask: torch.Tensor) -> tuple[list[int], list[int]]:
    """Each row's real span ``[s, e)`` (first and one past the last real token), checked to be
    contiguous: a pad between real tokens cannot be packed away without moving positions."""
    real = attention_mask.bool()
    counts = real.sum(1)
    idx = torch.arange(real.shape[1], device=real.device)
    first = torch.where(real, idx, real.shape[1]).amin(1)
    last = torch.where(real, idx, -1).amax(1)
    if bool((counts == 0).any()):
        raise ValueError(f"row {int((counts == 0).nonzero()[0])} has no real token to pack")
    holes = (last - first + 1) != counts
    if bool(holes.any()):
        raise ValueError(f"row {int(holes.nonzero()[0])}: its real tokens are not contiguous (a pad inside the row); it cannot be packed")
    return first.tolist(), (last + 1).tolist()


def pack_rows(lengths: Sequence[int], budget: int, count: int | None = None) -> list[list[int]]:
    """Row indices of each pack: first-fit decreasing into packs of at most ``budget``
    tokens (ties by row index; each pack's rows in row order). With ``count`` (at most the
    number of rows), packs with the most rows are split in two, their rows dealt longest
    first to the lighter half, until there are ``count``: every replica of an FSDP2 stage
    must run as many micro-batches as the others (each one all-gathers the weights over
    dp), and a pipeline needs pp of them to overlap its stages."""
    too_long = [i for i, n in enumerate(lengths) if n > budget]
    if too_long:
        i = too_long[0]
        raise ValueError(f"row {i} of the share holds {lengths[i]} tokens, more than micro_batch_tokens={budget}: a row is never split")
    packs: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        j = next((j for j, r in enumerate(room) if r >= lengths[i]), len(packs))
        if j == len(packs):
            packs.append([])
            room.append(budget)
        packs[j].append(i)
        room[j] -= lengths[i]
    if count is not None:
        if count > len(lengths):
            raise ValueError(f"{count} packs asked of {len(lengths)} rows: a pack holds at least one row")
        while len(packs) < count:
            j = max(range(len(packs)), key=lambda j: (len(packs[j]), -j))
            halves: tuple[list[int], list[int]] = ([], [])
            for i in sorted(packs[j], key=lambda i: (-lengths[i], i)):
                light = min((0, 1), key=lambda h: (sum(lengths[r] for r in halves[h]), len(halves[h]), h))
                halves[light].append(i)
            packs[j:j + 1] = list(halves)
    return [sorted(p) for p in packs]


def pack_count(lengths: Sequence[int], budget: int) -> int:
    """How many packs ``pack_rows`` makes of ``lengths`` (before any split)."""
    return len(pack_rows(lengths, budget))


def balanced_order(lengths: Sequence[int], parts: int) -> list[int]:
    """A permutation of the rows whose ``parts`` equal contiguous chunks hold about equal
    tokens (each chunk's rows in row order): chunk c of the result is replica c's share."""
    n = len(lengths)
    if parts <= 1 or n % parts:
        return list(range(n))
    size = n // parts
    chunks: list[list[int]] = [[] for _ in range(parts)]
    tokens = [0] * parts
    for i in sorted(range(n), key=lambda i: (-lengths[i], i)):
        c = min((c for c in range(parts) if len(chunks[c]) < size), key=lambda c: (tokens[c], c))
        chunks[c].append(i)
        tokens[c] += lengths[i]
    return [i for chunk in chunks for i in sorted(chunk)]


@dataclass(frozen=True, kw_only=True)
class Packing:
    """A padded batch's rows in packs (module docstring). Positions ``pos`` are within a
    pack; every pack is ``width`` tokens wide (the longest pack: pipelining needs equal
    micro-batches), the tail of a shorter one padded with document id -1."""

    packs: list[list[int]]
    lengths: list[int]  # real tokens of each pack
    width: int
    input_ids: torch.Tensor  # [packs, width]
    position_ids: torch.Tensor  # [packs, width]: restarts at 0 at each row's first real token
    document_ids: torch.Tensor  # [packs, width]: the row's index within its pack; -1 for padding
    pack_of: torch.Tensor  # [rows]: the pack each row is in
    score_pos: torch.Tensor  # [rows, N]: the positions in its pack of the padded positions P-1 … T-2
    last_pos: torch.Tensor  # [rows]: its last real token's position in its pack

    def model_inputs(self, m: int | None = None) -> dict[str, torch.Tensor]:
        """The model's inputs: of every pack, ``width`` wide (pipelining), or of pack ``m``
        alone, as wide as its real tokens (no padding at all)."""
        rows, cols = (slice(None), slice(None)) if m is None else (slice(m, m + 1), slice(0, self.lengths[m]))
        return {"input_ids": self.input_ids[rows, cols], "position_ids": self.position_ids[rows, cols],
                "document_ids": self.document_ids[rows, cols]}

    def rows_of(self, batch: Mapping[str, torch.Tensor], m: int) -> dict[str, torch.Tensor]:
        """The micro-batch of pack ``m`` in the padded layout: its rows of every ``batch``
        tensor plus ``score_pos``/``last_pos``, which the output and loss functions gather
        with (``stages._response_logits``) instead of slicing."""
        rows = torch.tensor(self.packs[m], dtype=torch.long, device=self.pack_of.device)
        mb = {k: v[rows.to(v.device)] for k, v in batch.items()}
        mb["score_pos"], mb["last_pos"] = self.score_pos[rows], self.last_pos[rows]
        return mb

    def unpack(self, packed: torch.Tensor, *, at: str) -> torch.Tensor:
        """Per-row values in the padded layout from per-position values of the packs
        ``packed`` [packs, width, ...]: at each row's scoring window [rows, N, ...]
        (``at="score"``) or at its last real token [rows, ...] (``at="last"``)."""
        pos = self.score_pos if at == "score" else self.last_pos
        packs = self.pack_of[:, None].expand_as(pos) if at == "score" else self.pack_of
        return packed[packs.to(packed.device), pos.to(packed.device)]


def pack_batch(batch: Mapping[str, torch.Tensor], budget: int, count: int | None = None) -> Packing:
    """Pack the rows of ``batch`` (``input_ids`` [B, T], ``attention_mask``, ``prompt_width``)
    into packs of at most ``budget`` real tokens (exactly ``count`` packs: ``pack_rows``)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    p = int(batch["prompt_width"][0])
    starts, ends = row_spans(mask)
    empty = [i for i, s in enumerate(starts) if s > p - 1]
    if empty:
        raise ValueError(f"row {empty[0]} has no prompt token before column {p} (the prompt width): nothing scores its first response token")
    lengths = [e - s for s, e in zip(starts, ends)]
    packs = pack_rows(lengths, budget, count)
    sizes = [sum(lengths[i] for i in pack) for pack in packs]
    width = max(sizes)
    b, t = ids.shape
    n = t - p  # the response columns: scoring positions P-1 … T-2
    device, ids = ids.device, ids.cpu()  # built on the host, moved once
    input_ids = torch.zeros(len(packs), width, dtype=ids.dtype)
    position_ids = torch.zeros(len(packs), width, dtype=torch.long)
    document_ids = torch.full((len(packs), width), -1, dtype=torch.long)
    pack_of = torch.empty(b, dtype=torch.long)
    score_pos = torch.empty(b, n, dtype=torch.long)
    last_pos = torch.empty(b, dtype=torch.long)
    window = torch.arange(p - 1, t - 1)
    positions = torch.arange(t)
    for m, pack in enumerate(packs):
        at = 0
        for doc, i in enumerate(pack):
            s, e = starts[i], ends[i]
            input_ids[m, at : at + e - s] = ids[i, s:e]
            position_ids[m, at : at + e - s] = positions[: e - s]
            document_ids[m, at : at + e - s] = doc
            pack_of[i] = m
            # padded position q of row i sits at at + q - s; the window past the row's last
            # token (response padding, masked by every loss) reads its last token instead
            score_pos[i] = at + window.clamp(s, e - 1) - s
            last_pos[i] = at + e - 1 - s
            at += e - s
    return Packing(packs=packs, lengths=sizes, width=width, input_ids=input_ids.to(device), position_ids=position_ids.to(device),
                   document_ids=document_ids.to(device), pack_of=pack_of.to(device), score_pos=score_pos.to(device),
                   last_pos=last_pos.to(device))
