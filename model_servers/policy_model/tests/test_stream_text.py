"""A streamed reply's content: the deltas of decoding everything at every chunk, in time linear in the reply.

``Reference`` is that streamer written plainly: at every chunk it decodes all the ids so far and
reads all their text (cut at the earliest marker, less a tail that may still become one, less
trailing U+FFFD); where the text no longer starts with what it delivered and does not end in
U+FFFD, it goes on from where they part. Random generations in random chunks, with the eos, the
tool-call tag and stop strings (cut from their own text, or drawn from an alphabet holding U+FFFD)
go through both, on a byte-level tokenizer whose tokens end inside characters and on a
SentencePiece one whose byte fallback can turn text already sent into U+FFFD: every chunk's delta,
the final one and the content sent must be equal. Then whole replies through
``WorkerBackend.stream``: the deltas join to the content of the reply (with the text a later byte
turned into U+FFFD left in where it was sent), and a reply of 2,000 tokens decodes a few ids per
token, not all of them at every chunk.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model_servers.inference_worker import default_model_data as data
from model_servers.policy_model import worker_backend
from model_servers.policy_model.chat_format import ChatFormat
from model_servers.policy_model.generation import ChatCall, ChatResult, Sampling, TextDelta
from model_servers.policy_model.tests.byte_tokenizer import (
    MULTIBYTE_WORDS,
    build_byte_tokenizer,
    byte_chat_format,
    byte_ids,
    piece_ids,
)
from model_servers.policy_model.tests.scripted_worker import Generate, ScriptedWorker
from model_servers.policy_model.text_cut import ContentStreamer
from nemo_gym_ckpt.client import MeshClient

pytestmark = pytest.mark.unit

END = data.END
CALL_OPEN = data.TOOL_CALL_OPEN


# ---- the reference: the streamer as it was --------------------------------------------------------


class Reference:
    """All ids decoded and all text read at every chunk."""

    def __init__(self, tokenizer: Any, markers: Sequence[str]) -> None:
        self._tokenizer = tokenizer
        self._markers = [marker for marker in markers if marker]
        self.ids: list[int] = []
        self.delivered = ""  # what was sent, as far as the text still reads it
        self.emitted = ""

    def add(self, ids: Sequence[int]) -> str:
        self.ids += ids
        text = self._tokenizer.decode(self.ids, skip_special_tokens=False)
        if not text.startswith(self.delivered):
            if text.endswith("\ufffd"):
                return ""  # a byte still to come may undo the change
            self.delivered = self.delivered[: _parting(text, self.delivered)]
        return self._advance(self._safe(text))

    def finish(self, content: str) -> str:
        delta = content[_parting(content, self.delivered) :]
        self.delivered, self.emitted = content, self.emitted + delta
        return delta

    def _safe(self, text: str) -> str:
        cuts = [index for index in (text.find(marker) for marker in self._markers) if index >= 0]
        visible = text[: min(cuts, default=len(text))]
        if len(visible) == len(text):
            held = 0
            for marker in self._markers:
                for size in range(min(len(marker) - 1, len(text)), held, -1):
                    if text.endswith(marker[:size]):
                        held = size
                        break
            visible = visible[: len(visible) - held]
        return visible.rstrip("\ufffd")

    def _advance(self, visible: str) -> str:
        if len(visible) <= len(self.delivered):
            return ""
        delta = visible[len(self.delivered) :]
        self.delivered, self.emitted = visible, self.emitted + delta
        return delta


def _parting(text: str, delivered: str) -> int:
    """Where ``text`` and ``delivered`` part (the length of their common prefix)."""
    return next((index for index, (a, b) in enumerate(zip(text, delivered, strict=False)) if a != b),
                min(len(text), len(delivered)))


# ---- tokenizers ----------------------------------------------------------------------------------


@functools.cache
def byte_tokenizer() -> Any:
    return build_byte_tokenizer()


@functools.cache
def sentencepiece_tokenizer() -> Any:
    """Llama's decoder shape: "▁" for spaces, ``<0xNN>`` byte tokens, the first space stripped. A run
    of byte tokens that is no UTF-8 decodes to one U+FFFD a byte, so a new byte can turn the text
    already sent (a whole character) into U+FFFD."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {"<unk>": 0, **{f"<0x{byte:02X}>": 1 + byte for byte in range(256)}}
    for piece in ("▁the", "▁a", "a", "b", "▁", ".", "n't", "▁é", "€"):
        vocab.setdefault(piece, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens([AddedToken(END, special=True, normalized=False)])
    tokenizer.add_tokens([AddedToken(CALL_OPEN, special=False, normalized=False)])
    return tokenizer


def _tokenizer(name: str) -> Any:
    return byte_tokenizer() if name == "byte_level" else sentencepiece_tokenizer()


def _word_ids(tokenizer: Any) -> list[int]:
    """Ids that make whole characters, often split over several tokens (byte level), or every id."""
    if tokenizer is not byte_tokenizer():
        return list(range(tokenizer.get_vocab_size(with_added_tokens=True)))
    words = [ids for word in MULTIBYTE_WORDS for size in (2, 3) for ids in [piece_ids(word, size), byte_ids(word)]]
    return sorted({token for ids in words for token in ids} | set(byte_ids("ab .'<|>_\n")))


@st.composite
def generations(draw: st.DrawFn, tokenizer: Any) -> tuple[list[list[int]], list[str]]:
    """Chunks of ids (one to three a chunk) and the markers: the eos, the tool-call tag perhaps and
    stop strings."""
    every = range(tokenizer.get_vocab_size(with_added_tokens=True))
    pool = st.one_of(st.sampled_from(_word_ids(tokenizer)), st.sampled_from(every))
    ids = draw(st.lists(pool, min_size=1, max_size=48))
    text = tokenizer.decode(ids, skip_special_tokens=False)
    cut = st.nothing()
    if text:
        cut = st.integers(0, len(text) - 1).flatmap(
            lambda i: st.integers(i + 1, min(len(text), i + 8)).map(lambda j: text[i:j]))
    stops = draw(st.lists(st.one_of(cut, st.text(alphabet="aé€ .'<|\ufffd", min_size=1, max_size=3)), max_size=4))
    markers = [END, *([CALL_OPEN] if draw(st.booleans()) else []), *stops]
    sizes = draw(st.lists(st.integers(1, 3), min_size=len(ids), max_size=len(ids)))
    chunks, start = [], 0
    for size in sizes:
        if start < len(ids):
            chunks.append(ids[start : start + size])
            start += size
    return chunks, markers


def assert_same_as_reference(tokenizer: Any, chunks: Sequence[Sequence[int]], markers: Sequence[str]) -> None:
    streamer, reference = ContentStreamer(tokenizer, markers), Reference(tokenizer, markers)
    for index, chunk in enumerate(chunks):
        assert streamer.add(chunk) == reference.add(chunk), index
    assert streamer.emitted == reference.emitted
    text = tokenizer.decode(reference.ids, skip_special_tokens=False)
    cuts = [index for index in (text.find(marker) for marker in markers if marker) if index >= 0]
    content = text[: min(cuts, default=len(text))]
    assert streamer.finish(content) == reference.finish(content)
    assert streamer.emitted == reference.emitted


@pytest.mark.parametrize("name", ["byte_level", "sentencepiece"])
@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_streams_send_the_reference_deltas(name: str, data: st.DataObject) -> None:
    tokenizer = _tokenizer(name)
    chunks, markers = data.draw(generations(tokenizer))
    assert_same_as_reference(tokenizer, chunks, markers)


# ---- the cases named -----------------------------------------------------------------------------


def _char_ids(fmt: ChatFormat, text: str) -> list[int]:
    return fmt.encode(text)  # the chat tokenizer: one id per character, a special token's text one id


def test_a_tail_that_may_become_a_marker_is_held_back(fmt: ChatFormat) -> None:
    streamer = ContentStreamer(fmt, [END, CALL_OPEN])
    assert streamer.add(_char_ids(fmt, "Hel")) == "Hel"
    assert streamer.add(_char_ids(fmt, "lo <|e")) == "lo "  # "<|e" might be the start of <|end|>
    assert streamer.add(_char_ids(fmt, "x")) == "<|ex"  # it was not
    assert streamer.add(_char_ids(fmt, END)) == ""
    assert streamer.add(_char_ids(fmt, "more")) == ""
    assert streamer.finish("Hello <|ex") == ""
    assert streamer.emitted == "Hello <|ex"


def test_a_tool_call_stops_the_stream_and_the_parsed_content_finishes_it(fmt: ChatFormat) -> None:
    streamer = ContentStreamer(fmt, [END, CALL_OPEN])
    assert streamer.add(_char_ids(fmt, "Sure<tool_")) == "Sure"
    assert streamer.add(_char_ids(fmt, 'call>{"name"')) == ""
    assert streamer.finish("Sure, after") == ", after"
    assert streamer.emitted == "Sure, after"


def test_a_character_split_over_tokens_is_held_until_it_is_whole() -> None:
    streamer = ContentStreamer(byte_tokenizer(), [END])
    assert [streamer.add([token]) for token in byte_ids("caf€")] == ["c", "a", "f", "", "", "€"]
    assert [streamer.add([token]) for token in piece_ids("中文", 2)] == ["", "中", "文"]
    assert [streamer.add([token]) for token in piece_ids("naïve", 3)] == ["na", "ïve"]


def test_sent_content_is_never_retracted_and_the_content_past_the_parting_is_sent(fmt: ChatFormat) -> None:
    streamer = ContentStreamer(fmt, [END])
    assert streamer.add(_char_ids(fmt, "abc")) == "abc"
    assert streamer.finish("abxyz") == "xyz"
    assert streamer.emitted == "abcxyz"


def _sentencepiece_ids(*tokens: str) -> list[int]:
    tokenizer = sentencepiece_tokenizer()
    return [tokenizer.token_to_id(token) for token in tokens]


SENT_THEN_FFFD = ("<0xC3>", "<0xA9>", "<0xE2>", "<0x82>", "<0xAC>", "a", "<0xC3>", "<0xA9>", "<0xFF>", "b", "▁the")
""""é€a", then "é", which the byte <0xFF> turns into U+FFFD (the run C3 A9 FF is no UTF-8), then "b the"."""


def test_a_byte_that_turns_sent_text_into_u_fffd_does_not_stall_the_stream() -> None:
    tokenizer = sentencepiece_tokenizer()
    ids = _sentencepiece_ids(*SENT_THEN_FFFD)
    assert tokenizer.decode(ids[:3]) == "\ufffd" * 3 and tokenizer.decode(ids[:5]) == "é€"
    content = tokenizer.decode(ids)
    assert content == "é€a" + "\ufffd" * 3 + "b the"
    streamer = ContentStreamer(tokenizer, [END])
    deltas = [streamer.add([token]) for token in ids]
    # the "é" sent stays sent; from where the text parts from it on, the whole content is sent
    assert deltas == ["", "é", "", "", "€", "a", "", "é", "", "\ufffd" * 3 + "b", " the"]
    assert streamer.finish(content) == ""
    assert streamer.emitted == "é€aé" + content[3:]
    assert_same_as_reference(tokenizer, [[token] for token in ids], [END])


def test_a_stream_that_ends_on_the_parting_byte_sends_the_rest_at_its_end() -> None:
    tokenizer = sentencepiece_tokenizer()
    ids = _sentencepiece_ids(*SENT_THEN_FFFD[:9])
    streamer = ContentStreamer(tokenizer, [END])
    assert "".join(streamer.add([token]) for token in ids) == "é€aé"
    assert streamer.finish(tokenizer.decode(ids)) == "\ufffd" * 3
    assert streamer.emitted == "é€aé" + "\ufffd" * 3


def test_text_that_ends_in_u_fffd_for_a_while_is_not_sent_twice() -> None:
    """"é", then a byte that makes the run U+FFFD until the next byte makes it "éé" again."""
    tokenizer = sentencepiece_tokenizer()
    ids = _sentencepiece_ids("<0xC3>", "<0xA9>", "<0xC3>", "<0xA9>", "b")
    assert tokenizer.decode(ids[:3]) == "\ufffd" * 3
    streamer = ContentStreamer(tokenizer, [END])
    assert [streamer.add([token]) for token in ids] == ["", "é", "", "é", "b"]
    assert streamer.finish("ééb") == "" and streamer.emitted == "ééb"


# ---- through the backend -------------------------------------------------------------------------


class CountingTokenizer:
    """A ``tokenizers.Tokenizer`` counting the ids it is asked to decode."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.decoded_ids = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.decoded_ids += len(ids)
        return str(self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))


async def stream_reply(fmt: ChatFormat, ids: Sequence[int], monkeypatch: pytest.MonkeyPatch
                       ) -> tuple[list[str], ChatResult]:
    """Stream ``ids`` (the eos appended) from a scripted worker through ``WorkerBackend.stream``."""
    monkeypatch.setattr(worker_backend, "load_chat_format", lambda _directory: fmt)
    worker = ScriptedWorker(byte_chat_format()).will(Generate("", token_ids=tuple(ids)))
    deltas: list[str] = []
    async with MeshClient(transport=httpx.ASGITransport(app=worker.app)) as client:
        backend = worker_backend.WorkerBackend(client=client, url="http://worker", tokenizer_dir="unused",
                                               model_name="m", timeout_s=30)
        await backend.start()
        call = ChatCall([{"role": "user", "content": "go"}], None, Sampling(1.0, 1.0, len(ids) + 1))
        async for event in backend.stream(call):
            if isinstance(event, TextDelta):
                deltas.append(event.text)
            elif isinstance(event, ChatResult):
                return deltas, event
    raise AssertionError("the stream ended without a result")


async def test_deltas_of_characters_split_over_tokens_join_to_the_whole_decode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fmt = byte_chat_format()
    ids = [*byte_ids("Voilà: "), *piece_ids("中文", 2), *byte_ids(" €5 "), *piece_ids(" café", 3),
           *piece_ids("😀", 2), *byte_ids(" & "), *piece_ids("naïve", 3), *byte_ids("!")]
    deltas, result = await stream_reply(fmt, ids, monkeypatch)
    assert result.content == fmt.decode(ids) == "Voilà: 中文 €5  café😀 & naïve!"
    assert "".join(deltas) == result.content
    assert "\ufffd" not in "".join(deltas) and len(deltas) > 10


async def test_a_stream_whose_sent_text_a_later_byte_turns_into_u_fffd_sends_the_rest_of_the_content(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: the stream sent "é€aé" and nothing more, not even at its end."""
    tokenizer = sentencepiece_tokenizer()
    deltas, result = await stream_reply(byte_chat_format(tokenizer), _sentencepiece_ids(*SENT_THEN_FFFD), monkeypatch)
    assert result.content == "é€a" + "\ufffd" * 3 + "b the"
    assert "".join(deltas) == "é€aé" + result.content[3:]  # the "é" sent, then the content from where it parts


async def test_a_long_stream_decodes_a_few_ids_per_token_not_all_of_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: every chunk decoded all ids so far (n * (n + 1) / 2 + n = 2,003,000 ids for 2,000)."""
    counting = CountingTokenizer(build_byte_tokenizer())
    ids = byte_ids("the quick brown fox jumps over the lazy dog, café. " * 40)[:1999]
    deltas, result = await stream_reply(byte_chat_format(counting), ids, monkeypatch)
    assert result.completion_tokens == 2000 and "".join(deltas) == result.content == byte_chat_format().decode(ids)
    assert counting.decoded_ids <= 24 * 2000, counting.decoded_ids
