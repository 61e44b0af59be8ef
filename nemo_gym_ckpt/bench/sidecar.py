"""``sidecar_copy`` (``bench --only checkpoint``): a full commit of the policy model whose token lines an
earlier commit already made durable.

A full commit (``incremental: false``) writes everything again: the policy model reads each token
line back from the earlier sidecar (checked against the CRC-32 taken when it left memory, since stop
39, one CRC over each run of lines whose CRCs chain since stop 43; against its digest before) and
writes it to the new one. At two
sizes of that earlier sidecar (the same lines of ``line_bytes``, a small and a large number of
them), in one run: the commit's wall time and write speed against the fsync'd sequential floor of
the same bytes, measured right after it; and the peak of the Python memory the commit allocates
(``tracemalloc``, in a second commit of the same lines, as tracing slows it) over the sidecar's
bytes. A commit that holds one chunk at a time shows a peak that does not grow with the sidecar:
the large size's peak over the small one's stays near 1 (before stop 35, both copies of every
line: twice the sidecar's bytes). Then the restore of that commit (each record a ledger naming its
line): the Python memory it still holds once read (the records; before stop 35 every line as well),
over the sidecar's bytes, and its peak; and the time it takes, untraced (``restore_ms``: the sidecar
found through its index (since stop 39; before, every line hashed and the file checked against its
name), each line read, hashed, parsed and checked against its row as the ledger's install does);
and the time of a restore whose scope holds a tenth of the rollouts (``restore_tenth_ms``: through
the index, only their lines are read), over the whole one's.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import time
import tracemalloc
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson

from model_servers.policy_model.capture_memory import LineFile
from model_servers.policy_model.token_sidecar import TOKEN_DIGEST, CallTokens, SidecarStore, TokenedRecord
from nemo_gym_ckpt.bench.floors import median_floor
from nemo_gym_ckpt.canonical import sha256_of
from nemo_gym_ckpt.checkpoint.records import Record
from nemo_gym_ckpt.checkpoint.store import CheckpointStore, StopSignal
from nemo_gym_ckpt.identity import RolloutIdentity

__all__ = ["sidecar_copy"]

Result = dict[str, Any]
MB = 1_000_000


def sidecar_copy(
    sizes_mb: tuple[float, float] = (16, 160), line_bytes: int = 20_000, root: Path | None = None
) -> Result:
    """The full commit of earlier token lines of ``sizes_mb`` (small, large) megabytes."""
    work = Path(tempfile.mkdtemp(prefix="ngc-bench-sidecar-", dir=root))
    try:
        rows = [_copy_row(work / f"size-{n}", size, line_bytes) for n, size in enumerate(sizes_mb)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    small, large = rows
    return {"line_bytes": line_bytes, "small": small, "large": large,
            "large_over_small_peak": round(large["peak_traced_mb"] / max(small["peak_traced_mb"], 1e-9), 2)}


def _copy_row(directory: Path, size_mb: float, line_bytes: int) -> Result:
    directory.mkdir()
    tokens = _kept_lines(directory / "earlier.jsonl", max(1, int(size_mb * MB) // line_bytes), line_bytes)
    sidecar_bytes = sum(line.size + 1 for line in tokens)
    ledgers = [Record.from_data({"episode_id": {"rollout_id": f"r{number}", "attempt": 0},
                                 "ledger": [{"call_id": line.call_id, TOKEN_DIGEST: line.digest, **_digests(line)}]})
               for number, line in enumerate(tokens)]
    began = time.perf_counter()
    _full_commit(directory / "timed", tokens, ledgers)
    commit_s = time.perf_counter() - began
    floor = median_floor(directory, sidecar_bytes)
    with _traced() as peak:
        _full_commit(directory / "traced", tokens, ledgers)
    scope = frozenset(record.episode for record in ledgers)
    del tokens, ledgers
    restore_s = _restore_time(directory, scope)
    tenth = frozenset(sorted(scope, key=lambda episode: episode.rollout_id)[::10])
    restore_tenth_s = _restore_time(directory, tenth)
    held, restore_peak = _restore_memory(directory, scope)
    write_mb_s = sidecar_bytes / commit_s / MB
    return {"lines": len(scope), "sidecar_mb": round(sidecar_bytes / MB, 2), "commit_ms": round(1000 * commit_s, 1),
            "write_mb_s": round(write_mb_s, 1), "fsync_floor_mb_s": round(floor, 1),
            "over_floor": round(write_mb_s / max(floor, 1e-9), 3), "peak_traced_mb": round(peak[0] / MB, 2),
            "peak_over_sidecar": round(peak[0] / sidecar_bytes, 4), "restore_held_mb": round(held / MB, 2),
            "restore_held_over_sidecar": round(held / sidecar_bytes, 4),
            "restore_peak_mb": round(restore_peak / MB, 2), "restore_ms": round(1000 * restore_s, 1),
            "restore_mb_s": round(sidecar_bytes / restore_s / MB, 1),
            "restore_tenth_ms": round(1000 * restore_tenth_s, 1),
            "restore_tenth_over_all": round(restore_tenth_s / restore_s, 3)}


def _restore_time(directory: Path, scope: frozenset[RolloutIdentity]) -> float:
    """Seconds to read back the timed commit and check each line against its row as the ledger's
    install does (``CallTokens.check``), untraced."""
    began = time.perf_counter()
    result = SidecarStore(CheckpointStore(directory), list).read(directory / "timed", "model", "bench", scope)
    for record in result.records:
        [row] = record.data["ledger"]
        tokens = record.tokens[row["call_id"]] if isinstance(record, TokenedRecord) else None
        if tokens is None:
            raise RuntimeError(f"the restore lost the line of {row['call_id']}")
        tokens.check(row["call_id"], row["prompt_digest"], row["output_digest"], "sidecar_copy")
    return time.perf_counter() - began


def _digests(line: CallTokens) -> dict[str, str]:
    """The prompt and output digests a ledger row holds for ``line``."""
    data = orjson.loads(line.line)
    return {"prompt_digest": sha256_of(data["prompt_token_ids"]),
            "output_digest": sha256_of(data["generation_token_ids"])}


def _restore_memory(directory: Path, scope: frozenset[RolloutIdentity]) -> tuple[int, int]:
    """The Python memory the restore of the timed commit holds once read, and its peak."""
    with _traced() as peak:
        restored = SidecarStore(CheckpointStore(directory), list).read(directory / "timed", "model", "bench", scope)
        held, _ = tracemalloc.get_traced_memory()
    del restored
    return held, peak[0]


@contextmanager
def _traced() -> Iterator[list[int]]:
    """Trace Python allocations inside; the list holds their peak once out."""
    peak: list[int] = []
    tracemalloc.start()
    try:
        yield peak
        peak.append(tracemalloc.get_traced_memory()[1])
    finally:
        tracemalloc.stop()


def _kept_lines(path: Path, count: int, line_bytes: int) -> list[CallTokens]:
    """``count`` sidecar lines of about ``line_bytes`` written to ``path`` and kept there, out of memory
    (as the lines of an earlier commit are)."""
    ids = list(range(10_000, 10_000 + max(1, line_bytes // 17)))  # 6 bytes an id, 5 a log-prob
    file_tokens: list[tuple[str, int, bytes]] = []
    offset = 0
    with path.open("wb") as out:
        for number in range(count):
            generation = ids[: len(ids) - number % 5]
            line = orjson.dumps({"call_id": f"mc_{number}", "prompt_token_ids": ids[number % 7:],
                                 "generation_token_ids": generation, "generation_log_probs": [-0.5] * len(generation)})
            out.write(line + b"\n")
            file_tokens.append((f"mc_{number}", offset, line))
            offset += len(line) + 1
    file = LineFile.open(path)
    kept: list[CallTokens] = []
    crc = 0
    for call_id, at, line in file_tokens:  # their CRCs chained, as a commit's are when they leave memory
        tokens = CallTokens(call_id, line, hashlib.sha256(line).hexdigest())
        tokens.kept_at(file, at, crc)
        crc = tokens.crc or 0
        kept.append(tokens)
    return kept


def _full_commit(directory: Path, tokens: Sequence[CallTokens], ledgers: list[Record]) -> None:
    """The policy model's store commits ``ledgers`` and their ``tokens`` in full."""
    store = SidecarStore(CheckpointStore(directory), lambda: tokens)
    writer = store.open_writer(directory, "model", "bench", StopSignal(), incremental=False)
    writer.write_records(ledgers)
    writer.finish("model", "bench", "sidecar-copy")
