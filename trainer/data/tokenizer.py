"""A model directory's own tokenizer, as a dataset job uses it (``transformers.AutoTokenizer``).

What a job needs from it, and where each comes from:

- ``vocab_size``: ``len(tokenizer)``, the base vocabulary plus added tokens (the model's
  embedding may be larger, padded to a multiple; never smaller).
- ``eos_ids`` (the stop tokens of generation): the tokenizer's ``eos_token`` first, then
  every ``eos_token_id`` of ``generation_config.json`` (an int or a list: Llama-3 Instruct
  stops on ``<|eot_id|>`` and ``<|end_of_text|>``), without repeats. ``pad_id``: the
  tokenizer's pad token, else the first stop token; ``bos_id`` or None.
- Prompts. Chat messages (``[{"role", "content"}, ...]``) are rendered to text by the
  tokenizer's chat template with ``add_generation_prompt=True`` and that text is tokenized
  with ``add_special_tokens=False`` (verl's route; the template writes the BOS itself):
  the ids equal ``apply_chat_template(messages, tokenize=True, add_generation_prompt=True)``.
  Plain text is tokenized as the tokenizer does by default (``add_special_tokens=True``,
  so a BOS where its post-processor adds one). ``encode_prompts`` renders and tokenizes a
  whole list in two batched calls (the Rust tokenizer runs the batch in parallel).
- Responses: ``decode`` skips special tokens, so a reward function sees the answer text
  without the stop token.

Errors are one line naming the directory: a missing directory, one without tokenizer files,
one transformers cannot load, chat messages for a tokenizer without a chat template.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
Messages = list[dict]
Prompt = str | Messages


class TokenizerError(ValueError):
    """A tokenizer directory that cannot serve a job; the message names the directory."""


class TextTokenizer:
    """A loaded tokenizer (``load_tokenizer``): ids, stop tokens, prompt encoding, decoding."""

    def __init__(self, hf, *, path: str, eos_ids: tuple[int, ...], pad_id: int, bos_id: int | None):
        self.hf = hf  # the transformers tokenizer
        self.path = path
        self.eos_ids = eos_ids
        self.pad_id = pad_id
        self.bos_id = bos_id
        self.vocab_size = len(hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def _require_template(self) -> None:
        if not self.has_chat_template:
            raise TokenizerError(
                f"{self.path}: the tokenizer has no chat template, so prompts given as chat messages cannot be "
                "rendered (add 'chat_template' to tokenizer_config.json or a chat_template.jinja, or give text prompts)"
            )

    def render(self, messages: Messages | Sequence[Messages]) -> str | list[str]:
        """The chat template's text for one conversation (or a list of them), with the generation prompt."""
        self._require_template()
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        return self.encode_prompts([prompt])[0]

    def encode_prompts(self, prompts: Sequence[Prompt]) -> list[list[int]]:
        """Token ids of each prompt (text, or chat messages through the chat template), batched."""
        chats = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
        texts = [i for i, p in enumerate(prompts) if isinstance(p, str)]
        out: list[list[int]] = [[] for _ in prompts]
        if chats:
            rendered = self.render([list(prompts[i]) for i in chats])
            for i, ids in zip(chats, self.hf(rendered, add_special_tokens=False)["input_ids"]):
                out[i] = list(ids)
        if texts:
            for i, ids in zip(texts, self.hf([prompts[i] for i in texts])["input_ids"]):
                out[i] = list(ids)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens (stop, pad) left out: what reward functions score."""
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def __repr__(self) -> str:
        return (f"TextTokenizer({self.path!r}, vocab_size={self.vocab_size}, eos_ids={self.eos_ids}, "
                f"pad_id={self.pad_id}, bos_id={self.bos_id})")


def generation_eos_ids(path: str) -> tuple[int, ...]:
    """``eos_token_id`` of ``generation_config.json`` in ``path`` (an int, a list, or absent)."""
    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        return ()
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{file}: not readable JSON ({e})") from None
    value = config.get("eos_token_id") if isinstance(config, dict) else None
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise TokenizerError(f"{file}: eos_token_id must be an int or a list of ints, got {value!r}")
    return tuple(values)


def load_tokenizer(path: str | os.PathLike) -> TextTokenizer:
    """The tokenizer of a local directory (a model directory or a tokenizer of its own)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise TokenizerError(f"{path}: no such tokenizer directory" + (" (it is a file)" if os.path.exists(path) else ""))
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        raise TokenizerError(f"{path}: no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)})")
    import transformers  # slow to import: only a dataset job pays for it

    try:
        hf = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # transformers raises many kinds; one line naming the directory instead
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise TokenizerError(f"{path}: transformers could not load the tokenizer: {type(e).__name__}: {first}") from None
    vocab = len(hf)
    eos: list[int] = []
    for i in ([hf.eos_token_id] if hf.eos_token_id is not None else []) + list(generation_eos_ids(path)):
        if not 0 <= i < vocab:
            raise TokenizerError(f"{path}: eos token id {i} is outside the vocabulary of {vocab} tokens")
        if i not in eos:
            eos.append(i)
    if not eos:
        raise TokenizerError(
            f"{path}: no stop token (neither an eos_token in the tokenizer nor an eos_token_id in generation_config.json)"
        )
    pad = hf.pad_token_id if hf.pad_token_id is not None else eos[0]
    return TextTokenizer(hf, path=path, eos_ids=tuple(eos), pad_id=pad, bos_id=hf.bos_token_id)
