"""How the transformers engine computes one decode step: next-token logits for a batch of sequences.

Two strategies behind one method, ``logits(sequences) -> Tensor[batch, vocab]``:

- ``FullRecompute``: one forward over the left-padded full sequences, no KV cache. A sequence's
  logits depend only on its tokens, so a generation continued from prompt + prefix runs exactly the
  operations of the uninterrupted one (bit-equal alone in a batch).
- ``CachedDecode`` (the engine's default): one KV cache for the whole batch (``_KVStore``). New
  sequences are prefilled together and their caches copied in as new rows; sequences that left are
  swapped out row by row; every decode step writes its one new column in place. So joining and
  leaving cost a copy of the rows concerned, never a rebuild of the batch cache, and a step copies
  nothing it did not compute. The cache of a sequence that left goes to a bounded prefix pool
  (``_PrefixPool``): a new sequence whose ids extend it (an agent's next turn: prompt + previous
  generation + tool output; a continuation after a cut) prefills only the tokens past it. Logits
  computed from a re-prefilled or reused prefix agree with token-by-token decoding only to float
  noise (~1e-7): tokens match except at exact near-ties. A prompt repeated as is never reuses a
  cache, so repeating a request repeats its logprobs bit for bit.

Both run in the engine's worker thread under ``torch.inference_mode``; torch and transformers are
imported lazily.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["COLUMN_SLACK", "POOL_BYTES", "POOL_ENTRIES", "CachedDecode", "FullRecompute", "StepSequence", "Stepper"]

#: Spare columns kept on each side of the visible window when the store is (re)allocated.
COLUMN_SLACK = 64
#: The prefix pool's default bounds: entries, and bytes of keys and values.
POOL_ENTRIES = 128
POOL_BYTES = 256 * 2**20


class StepSequence(Protocol):
    """A sequence being generated: all its token ids, and a slot the stepper marks it with."""

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
    """A batch KV cache: row ``i`` of the store holds the cache of ``rows[i]``, left-padded.

    A sequence in the store has ``seq.cache`` set to this stepper. One that is absent from a call
    (finished or cancelled) gets ``None`` back, and its cache goes to the prefix pool: a later
    sequence whose ids extend its ids (the next turn of the same conversation, a continuation after
    a cut) prefills only the tokens past that prefix. ``prefilled_tokens`` and ``reused_tokens``
    count both kinds.
    """

    def __init__(
        self, model: Any, pad_id: int, *, pool_size: int = POOL_ENTRIES, pool_bytes: int = POOL_BYTES
    ) -> None:
        self._model = model
        self._pad = pad_id
        self._store: _KVStore | None = None
        self._pool = _PrefixPool(pool_size, pool_bytes)
        self.prefilled_tokens = 0
        self.reused_tokens = 0

    @property
    def rows(self) -> list[StepSequence]:
        """The sequences whose cache the store holds, in row order (a snapshot)."""
        return [] if self._store is None else list(self._store.seqs)

    def logits(self, sequences: Sequence[StepSequence]) -> Any:
        import torch

        self._drop_absent(sequences)
        order = self.rows
        parts = [self._decode()] if order else []
        for group in self._pool.groups([seq for seq in sequences if seq.cache is not self]):
            parts.append(self._prefill(group))
            order += [seq for seq, _ in group]
        where = {id(seq): row for row, seq in enumerate(order)}
        index = torch.tensor([where[id(seq)] for seq in sequences])
        return torch.cat(parts).index_select(0, index)

    def _drop_absent(self, sequences: Sequence[StepSequence]) -> None:
        if self._store is None:
            return
        wanted = {id(seq) for seq in sequences}
        gone = [row for row, seq in enumerate(self._store.seqs) if id(seq) not in wanted]
        for seq, layers in self._store.remove(gone):
            seq.cache = None
            self._pool.put(tuple(seq.ids[: layers[0][0].shape[1]]), layers)

    def _decode(self) -> Any:
        import torch

        store = self._store
        assert store is not None
        step_ids = torch.tensor([[seq.ids[-1]] for seq in store.seqs])
        positions = torch.tensor([[len(seq.ids) - 1] for seq in store.seqs])
        mask = store.open_column()
        out = self._model(input_ids=step_ids, attention_mask=mask, position_ids=positions,
                          cache=store.cache, use_cache=True)
        store.close_column()
        return out.logits[:, -1, :]

    def _prefill(self, group: list[tuple[StepSequence, _Prefix | None]]) -> Any:
        """One forward over the tokens of ``group`` past their reused prefixes; rows join the store."""
        sequences = [seq for seq, _ in group]
        lengths = [0 if prefix is None else prefix.length for _, prefix in group]
        ids, new_mask = _left_padded([seq.ids[n:] for seq, n in zip(sequences, lengths, strict=True)],
                                     self._pad)
        cache, mask = _past_cache([prefix for _, prefix in group], new_mask)
        out = self._model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=1,
                          position_ids=_positions(mask)[:, mask.shape[1] - ids.shape[1] :])
        layers = [(layer.keys, layer.values) for layer in cache.layers]
        if self._store is None:
            self._store = _KVStore(layers[0][0], len(layers))
        self._store.add(layers, mask, sequences)
        for seq in sequences:
            seq.cache = self
        self.reused_tokens += sum(lengths)
        self.prefilled_tokens += int(new_mask.sum())
        return out.logits[:, -1, :]


def _past_cache(prefixes: list[_Prefix | None], new_mask: Any) -> tuple[Any, Any]:
    """A transformers cache holding the reused prefixes (left-padded), and the mask over past + new."""
    import torch
    from transformers import DynamicCache

    width = max((prefix.length for prefix in prefixes if prefix is not None), default=0)
    if width == 0:
        return DynamicCache(), new_mask
    like = next(prefix for prefix in prefixes if prefix is not None).layers
    past_mask = new_mask.new_zeros(len(prefixes), width)
    layers = []
    for layer, (keys, _) in enumerate(like):
        heads, _, dim = keys.shape
        past = [keys.new_zeros(len(prefixes), heads, width, dim) for _ in range(2)]
        for row, prefix in enumerate(prefixes):
            if prefix is not None:
                for side in range(2):
                    past[side][row, :, width - prefix.length :] = prefix.layers[layer][side]
        layers.append((past[0], past[1]))
    for row, prefix in enumerate(prefixes):
        if prefix is not None:
            past_mask[row, width - prefix.length :] = 1
    return DynamicCache(ddp_cache_data=layers), torch.cat([past_mask, new_mask], dim=1)


class _Prefix:
    """A reused cache: per-layer keys and values ``[heads, length, head_dim]`` of ``ids[:length]``."""

    def __init__(self, length: int, layers: list[tuple[Any, Any]]) -> None:
        self.length = length
        self.layers = layers


class _PrefixPool:
    """Caches of sequences that left the batch, by their token ids; least recently used go first.

    Bounded by ``capacity`` entries and ``max_bytes`` of keys and values.
    """

    def __init__(self, capacity: int, max_bytes: int) -> None:
        self._capacity = capacity
        self._max_bytes = max_bytes
        self._bytes = 0
        self._entries: OrderedDict[tuple[int, ...], list[tuple[Any, Any]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def put(self, ids: tuple[int, ...], layers: list[tuple[Any, Any]]) -> None:
        size = _nbytes(layers)
        if self._capacity <= 0 or not ids or size > self._max_bytes:
            return
        self._pop(ids)
        self._entries[ids] = layers
        self._bytes += size
        while len(self._entries) > self._capacity or self._bytes > self._max_bytes:
            self._pop(next(iter(self._entries)))

    def _pop(self, ids: tuple[int, ...]) -> list[tuple[Any, Any]] | None:
        layers = self._entries.pop(ids, None)
        if layers is not None:
            self._bytes -= _nbytes(layers)
        return layers

    def groups(
        self, sequences: list[StepSequence]
    ) -> list[list[tuple[StepSequence, _Prefix | None]]]:
        """``sequences`` with the prefix each reuses: those without one, then those with one."""
        found = [(seq, self.take(seq.ids)) for seq in sequences]
        misses = [item for item in found if item[1] is None]
        hits = [item for item in found if item[1] is not None]
        return [group for group in (misses, hits) if group]

    def take(self, ids: Sequence[int]) -> _Prefix | None:
        """The longest cached sequence that ``ids`` extends (by at least one token), out of the pool.

        Only whole entries are reused: a prompt repeated as is prefills again, so repeating a request
        repeats its logprobs bit for bit.
        """
        wanted = tuple(ids)
        best: tuple[int, ...] = ()
        for key in self._entries:
            size = len(key)
            if len(best) < size < len(wanted) and key[-1] == wanted[size - 1] and key == wanted[:size]:
                best = key
        layers = self._pop(best) if best else None
        return None if layers is None else _Prefix(len(best), layers)


def _nbytes(layers: list[tuple[Any, Any]]) -> int:
    return sum(keys.nbytes + values.nbytes for keys, values in layers)


class _KVStore:
    """Key and value buffers ``[row_capacity, heads, column_capacity, head_dim]`` per layer, and a mask.

    Rows ``[0, n)`` hold ``seqs``; columns ``[start, end)`` are the visible window, every row
    left-padded in it (mask 0 on padding; a row that joined with a reused prefix also has padding
    between the prefix and the tokens prefilled after it). Anything outside the window may hold
    stale but finite values (buffers start zeroed), so a masked column never turns attention into
    NaN.
    """

    def __init__(self, like: Any, layers: int) -> None:
        self._shape = (like.shape[1], like.shape[3])
        self.seqs: list[StepSequence] = []
        self.keys: list[Any] = [like.new_zeros(0, self._shape[0], 0, self._shape[1])] * layers
        self.values: list[Any] = list(self.keys)
        self.mask = like.new_zeros(0, 0, dtype=_long())
        self.start = self.end = 0
        self._like = like.new_zeros(0)  # dtype and device of the buffers
        self.cache = _view_cache(self, layers)

    @property
    def n(self) -> int:
        return len(self.seqs)

    def view(self, layer: int, extra: int = 0) -> tuple[Any, Any]:
        """The visible keys and values of ``layer``, plus ``extra`` columns past the window."""
        cut = (slice(0, self.n), slice(None), slice(self.start, self.end + extra))
        return self.keys[layer][cut], self.values[layer][cut]

    def write(self, layer: int, keys: Any, values: Any) -> tuple[Any, Any]:
        """Put a forward's new columns right after the window; answers the window with them."""
        width = keys.shape[2]
        self.keys[layer][: self.n, :, self.end : self.end + width] = keys
        self.values[layer][: self.n, :, self.end : self.end + width] = values
        return self.view(layer, width)

    # ---- decode ----------------------------------------------------------------------------------

    def open_column(self) -> Any:
        """Make room for one column and mark it; answers the attention mask including it."""
        if self.end == self.mask.shape[1]:
            self._reallocate(self.mask.shape[0], COLUMN_SLACK)
        self.mask[: self.n, self.end] = 1
        return self.mask[: self.n, self.start : self.end + 1]

    def close_column(self) -> None:
        self.end += 1

    # ---- membership ------------------------------------------------------------------------------

    def add(self, layers: list[tuple[Any, Any]], mask: Any, seqs: list[StepSequence]) -> None:
        """Append prefilled rows (per-layer keys and values ``[len(seqs), heads, width, dim]``)."""
        rows, width = mask.shape
        start = min(self.start, self.end - width) if self.n else self.end - width
        if start < 0 or self.n + rows > self.mask.shape[0]:
            self._reallocate(self.n + rows + max(8, (self.n + rows) // 2), COLUMN_SLACK + width)
            start = min(self.start, self.end - width) if self.n else self.end - width
        new = slice(self.n, self.n + rows)
        for layer, (keys, values) in enumerate(layers):
            self.keys[layer][new, :, self.end - width : self.end] = keys
            self.values[layer][new, :, self.end - width : self.end] = values
        self.mask[new] = 0
        self.mask[new, self.end - width : self.end] = mask
        self.start = start
        self.seqs.extend(seqs)

    def remove(self, rows: list[int]) -> list[tuple[StepSequence, list[tuple[Any, Any]]]]:
        """Drop ``rows`` (the last row moves into each hole); answers each one's sequence and cache.

        The cache of a row is per layer ``(keys, values)`` ``[heads, length, head_dim]``: its
        unmasked columns, which hold ``seq.ids[:length]``.
        """
        dropped = []
        for row in sorted(rows, reverse=True):
            dropped.append((self.seqs[row], self._row_cache(row)))
            last = self.n - 1
            if row != last:
                self._move_row(last, row)
            self.seqs[row] = self.seqs[last]
            self.seqs.pop()
        if dropped:
            self._trim()
        return dropped

    def _row_cache(self, row: int) -> list[tuple[Any, Any]]:
        used = self.mask[row, self.start : self.end].bool()
        return [(keys[row, :, self.start : self.end][:, used], values[row, :, self.start : self.end][:, used])
                for keys, values in zip(self.keys, self.values, strict=True)]

    def _move_row(self, source: int, target: int) -> None:
        for buffers in (self.keys, self.values):
            for buffer in buffers:
                buffer[target] = buffer[source]
        self.mask[target] = self.mask[source]

    def _trim(self) -> None:
        """Move ``start`` right past the columns that are padding in every row."""
        if not self.n:
            self.start = self.end
            return
        used = self.mask[: self.n, self.start : self.end].amax(0)
        self.start += int(used.argmax())

    # ---- storage ---------------------------------------------------------------------------------

    def _reallocate(self, row_capacity: int, left: int) -> None:
        """New buffers; the window is copied to columns ``[left, left + width)``."""
        width = self.end - self.start
        columns = left + width + COLUMN_SLACK
        heads, dim = self._shape
        window = slice(left, left + width)
        for buffers in (self.keys, self.values):
            for layer, old in enumerate(buffers):
                new = self._like.new_zeros(row_capacity, heads, columns, dim)
                new[: self.n, :, window] = old[: self.n, :, self.start : self.end]
                buffers[layer] = new
        mask = self.mask.new_zeros(row_capacity, columns)
        mask[: self.n, window] = self.mask[: self.n, self.start : self.end]
        self.mask, self.start, self.end = mask, left, left + width


def _long() -> Any:
    import torch

    return torch.long


def _view_cache(store: _KVStore, layers: int) -> Any:
    """A transformers ``DynamicCache`` whose layers read and write ``store`` in place."""
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.layers = [_view_layer_class()(store, index) for index in range(layers)]
    return cache


@functools.cache
def _view_layer_class() -> type:
    from transformers.cache_utils import DynamicLayer

    class StoreLayer(DynamicLayer):
        """One layer of a ``_KVStore`` as transformers sees it: ``update`` writes in place."""

        def __init__(self, store: _KVStore, index: int) -> None:
            super().__init__()
            self.store = store
            self.index = index
            self.is_initialized = True
            self.device = store.keys[index].device
            self.keys, self.values = store.view(index)

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            self.keys, self.values = self.store.write(self.index, key_states, value_states)
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.store.end - self.store.start

    return StoreLayer
