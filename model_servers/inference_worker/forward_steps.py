"""How the transformers engine computes one decode step: next-token logits for a batch of sequences.

Two strategies behind one method, ``logits(sequences) -> Tensor[batch, vocab]``:

- ``FullRecompute`` (default): one forward over the left-padded full sequences, no KV cache. A
  sequence's logits depend only on its tokens, so a generation continued from prompt + prefix runs
  exactly the operations of the uninterrupted one (bit-equal alone in a batch).
- ``CachedDecode``: a KV cache per sequence. New sequences are prefilled together; the others
  decode one token each over one left-padded batch cache that lives on while the batch keeps the same
  members, and is rebuilt from per-sequence caches when it changes. Much cheaper per step at large
  batches, but a continued generation re-prefills its prefix where the original decoded it token by
  token, so logits agree only to float noise (~1e-7): tokens match except at exact near-ties.

Both run in the engine's worker thread under ``torch.inference_mode``; torch is imported lazily.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["CachedDecode", "FullRecompute", "StepSequence", "Stepper"]


class StepSequence(Protocol):
    """A sequence being generated: all its token ids, and a slot for the stepper's cache."""

    ids: list[int]
    cache: Any


class Stepper(Protocol):
    def logits(self, sequences: Sequence[StepSequence]) -> Any:
        """Next-token logits (float, [len(sequences), vocab]) in the order given."""
        ...


def _left_padded(rows: Sequence[Sequence[int]], pad: int) -> tuple[Any, Any]:
    import torch

    width = max(len(row) for row in rows)
    ids = torch.tensor([[pad] * (width - len(row)) + list(row) for row in rows])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    return ids, mask


def _positions(mask: Any) -> Any:
    return (mask.cumsum(-1) - 1).clamp_(min=0)


class FullRecompute:
    """No cache: every step is a forward over the whole sequences."""

    def __init__(self, model: Any, pad_id: int) -> None:
        self._model = model
        self._pad = pad_id

    def logits(self, sequences: Sequence[StepSequence]) -> Any:
        ids, mask = _left_padded([seq.ids for seq in sequences], self._pad)
        out = self._model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask),
                          use_cache=False, logits_to_keep=1)
        return out.logits[:, -1, :]


class CachedDecode:
    """KV caches: ``seq.cache`` holds a detached per-layer ``(keys, values)`` list covering ``ids[:-1]``.

    While the decode batch keeps the same members, their cache lives only in the batch cache
    (``seq.cache`` is stale); it is detached back into each member on a change of membership.
    """

    def __init__(self, model: Any, pad_id: int) -> None:
        self._model = model
        self._pad = pad_id
        self._members: list[StepSequence] = []
        self._cache: Any = None
        self._mask: Any = None

    def logits(self, sequences: Sequence[StepSequence]) -> Any:
        import torch

        decode = [seq for seq in sequences if seq.cache is not None]
        prefill = [seq for seq in sequences if seq.cache is None]
        rows: dict[int, Any] = {}
        if decode:
            rows.update(zip(map(id, decode), self._decode(decode), strict=True))
        if prefill:
            rows.update(zip(map(id, prefill), self._prefill(prefill), strict=True))
        return torch.stack([rows[id(seq)] for seq in sequences])

    def _prefill(self, sequences: list[StepSequence]) -> Any:
        from transformers import DynamicCache

        ids, mask = _left_padded([seq.ids for seq in sequences], self._pad)
        cache = DynamicCache()
        out = self._model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), cache=cache,
                          use_cache=True, logits_to_keep=1)
        for row, seq in enumerate(sequences):
            seq.cache = _detach_row(cache, row, ids.shape[1] - len(seq.ids))
        return out.logits[:, -1, :]

    def _decode(self, sequences: list[StepSequence]) -> Any:
        import torch

        if [id(seq) for seq in sequences] != [id(seq) for seq in self._members]:
            self._regroup(sequences)
        step_ids = torch.tensor([[seq.ids[-1]] for seq in sequences])
        self._mask = torch.cat([self._mask, torch.ones(len(sequences), 1, dtype=self._mask.dtype)], dim=1)
        positions = torch.tensor([[len(seq.ids) - 1] for seq in sequences])
        out = self._model(input_ids=step_ids, attention_mask=self._mask, position_ids=positions,
                          cache=self._cache, use_cache=True)
        return out.logits[:, -1, :]

    def _regroup(self, sequences: list[StepSequence]) -> None:
        """Detach the old members' caches, then build one batch cache for ``sequences``."""
        import torch
        from transformers import DynamicCache

        staying = {id(seq) for seq in sequences}
        for row, seq in enumerate(self._members):
            if id(seq) in staying:
                seq.cache = _detach_row(self._cache, row, int((self._mask[row] == 0).sum()))
        width = max(len(seq.ids) - 1 for seq in sequences)
        layers = []
        for layer in range(len(sequences[0].cache)):
            keys = [_pad_left(seq.cache[layer][0], width) for seq in sequences]
            values = [_pad_left(seq.cache[layer][1], width) for seq in sequences]
            layers.append((torch.cat(keys), torch.cat(values)))
        self._cache = DynamicCache(ddp_cache_data=layers)
        self._mask = torch.tensor([[0] * (width - len(seq.ids) + 1) + [1] * (len(seq.ids) - 1)
                                   for seq in sequences])
        self._members = list(sequences)


def _detach_row(cache: Any, row: int, pad: int) -> list[tuple[Any, Any]]:
    return [(layer.keys[row : row + 1, :, pad:].clone(), layer.values[row : row + 1, :, pad:].clone())
            for layer in cache.layers]


def _pad_left(tensor: Any, width: int) -> Any:
    import torch

    missing = width - tensor.shape[2]
    if missing == 0:
        return tensor
    zeros = tensor.new_zeros(tensor.shape[0], tensor.shape[1], missing, tensor.shape[3])
    return torch.cat([zeros, tensor], dim=2)
