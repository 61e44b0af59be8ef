"""The reply's text is built token by token in linear time, and is exactly what it was before.

``Reference`` is the straightforward builder the worker had: at every token it decodes all the ids
and searches all the text for every stop string. Random generations (hypothesis) with stop strings
cut from their own text (so they match, often across several tokens), random ones and ones holding
U+FFFD go through both, on four tokenizers: the default model's, a byte-level BPE whose tokens hold
parts of UTF-8 characters, a SentencePiece-style one (metaspace, byte fallback, a first space
stripped) and a character one whose decoder cleans up spaces (the path that decodes everything).
Every step's text, text offsets, finish, stop reason and stream chunk must be equal.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model_servers.inference_worker.completions import CompletionBuilder, CompletionPlan
from model_servers.inference_worker.detokenizer import KEPT_CHARS, RECENT_CHARS, IncrementalDetokenizer
from model_servers.inference_worker.engine import GenerationRequest, TokenStep
from model_servers.inference_worker.hf_tokenizer import HFTokenizer
from model_servers.inference_worker.model_dir import resolve_model_path
from model_servers.inference_worker.tests.byte_level import build_byte_tokenizer, byte_level_text

pytestmark = pytest.mark.unit

# ---- tokenizers ----------------------------------------------------------------------------------


@functools.cache
def default_tokenizer() -> HFTokenizer:
    return HFTokenizer.load(resolve_model_path(None))


@functools.cache
def byte_level_tokenizer() -> HFTokenizer:
    """Byte-level BPE (``byte_level.py``): tokens that may end inside a character."""
    from transformers import PreTrainedTokenizerFast

    return HFTokenizer(PreTrainedTokenizerFast(tokenizer_object=build_byte_tokenizer(), eos_token="<|end|>",
                                               clean_up_tokenization_spaces=False))


@functools.cache
def sentencepiece_tokenizer() -> HFTokenizer:
    """Llama's decoder shape: "▁" for spaces, ``<0xNN>`` byte tokens, the first space stripped."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{byte:02X}>": 3 + byte for byte in range(256)}}
    for piece in ("▁the", "▁a", "a", "b", "▁", ".", "n't", "▁é", "€"):
        vocab.setdefault(piece, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return HFTokenizer(PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>",
                                               bos_token="<s>", clean_up_tokenization_spaces=False))


@functools.cache
def cleanup_tokenizer() -> HFTokenizer:
    """One token per character, with transformers' clean-up of spaces (" ." -> "."): a new token
    changes the text before it."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(["<unk>", "<|end|>", *" .,'!?antsmvre"])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return HFTokenizer(PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|end|>", unk_token="<unk>",
                                               clean_up_tokenization_spaces=True))


# ---- the reference: the builder as it was ---------------------------------------------------------


@dataclass
class Reference:
    """All ids decoded and all text searched at every token; the stream's text held back as before."""

    tokenizer: HFTokenizer
    stops: tuple[str, ...]
    skip_special_tokens: bool
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_text: int = 0
    sent_tokens: int = 0

    def __post_init__(self) -> None:
        self.ids: list[int] = []
        self.text_ids: list[int] = []
        self.offsets: list[int] = []

    def add(self, token_id: int, finish: str | None) -> bool:
        self.ids.append(token_id)
        self.offsets.append(len(self.text))
        if finish == "stop":
            return self._finish("stop", None)
        self.text_ids.append(token_id)
        self.text = self.tokenizer.decode(self.text_ids, skip_special_tokens=self.skip_special_tokens)
        found = [(index, s) for index, s in ((self.text.find(s), s) for s in self.stops) if index >= 0]
        if found:
            index, stop = min(found)
            self.text = self.text[:index]
            return self._finish("stop", stop)
        return self._finish("length", None) if finish == "length" else False

    def _finish(self, reason: str, stop_reason: str | None) -> bool:
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.offsets = [min(offset, len(self.text)) for offset in self.offsets]
        return True

    def chunk_text(self) -> str | None:
        finished = self.finish_reason is not None
        safe = len(self.text) if finished else self._safe_text_length()
        if not finished and self.sent_tokens == len(self.ids) and safe <= self.sent_text:
            return None
        text = self.text[self.sent_text : safe] if safe > self.sent_text else ""
        self.sent_text, self.sent_tokens = max(self.sent_text, safe), len(self.ids)
        return text

    def _safe_text_length(self) -> int:
        safe = len(self.text) - (max((len(s) for s in self.stops), default=1) - 1)
        while safe > 0 and self.text[safe - 1] == "\ufffd":
            safe -= 1
        return max(safe, 0)


def _builder(tokenizer: Any, stops: Sequence[str], skip_special_tokens: bool, max_tokens: int) -> CompletionBuilder:
    plan = CompletionPlan(GenerationRequest((1,), max_tokens, 0), tuple(stops), True, True, skip_special_tokens,
                          False, True, True)
    return CompletionBuilder(plan, tokenizer, "m", 0)


def _steps(ids: Sequence[int], end_with_eos: bool, eos: int) -> list[TokenStep]:
    steps = [TokenStep(token, -0.25) for token in ids]
    if end_with_eos:
        return [*steps, TokenStep(eos, -0.5, "stop")]
    return [*steps[:-1], TokenStep(ids[-1], -0.25, "length")]


def assert_same_as_reference(tokenizer: HFTokenizer, ids: Sequence[int], stops: Sequence[str], *,
                             skip_special_tokens: bool, end_with_eos: bool) -> None:
    eos = tokenizer.eos_token_id
    assert eos is not None
    steps = _steps(ids, end_with_eos, eos)
    builder = _builder(tokenizer, stops, skip_special_tokens, len(steps))
    reference = Reference(tokenizer, tuple(stops), skip_special_tokens)
    for index, step in enumerate(steps):
        finished = builder.add(step)
        assert finished == reference.add(step.token_id, step.finish_reason), index
        assert (builder.text, builder.text_offsets) == (reference.text, reference.offsets), index
        assert (builder.finish_reason, builder.stop_reason) == (reference.finish_reason, reference.stop_reason)
        chunk = builder.chunk()
        assert (None if chunk is None else chunk["choices"][0]["text"]) == reference.chunk_text(), index
        if finished:
            break
    assert builder.response()["choices"][0]["text"] == reference.text


# ---- random generations ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    tokenizer: HFTokenizer
    ids: st.SearchStrategy[list[int]]  # a generation's ids, from every id but EOS (EOS only ends one)
    random_stops: st.SearchStrategy[str]  # stop strings from the case's alphabet


@functools.cache
def _case(name: str) -> Case:
    """One per tokenizer, its strategies built once (not at every example: reading ``eos_token_id``
    for each id of the vocabulary, and hashing the pool for a new ``sampled_from``, took most of the
    test's time)."""
    if name == "default":
        tokenizer, stop_alphabet = default_tokenizer(), "ab<>/_\n \ufffd"
    else:
        tokenizers = {"byte_level": byte_level_tokenizer, "sentencepiece": sentencepiece_tokenizer,
                      "cleanup": cleanup_tokenizer}
        tokenizer, stop_alphabet = tokenizers[name](), "aé€ .'\ufffd"
    eos = tokenizer.eos_token_id
    pool = tuple(i for i in range(tokenizer.vocab_size) if i != eos)
    return Case(tokenizer, st.lists(st.sampled_from(pool), min_size=1, max_size=40),
                st.text(alphabet=stop_alphabet, min_size=1, max_size=3))


@st.composite
def generations(draw: st.DrawFn, case: Case) -> tuple[list[int], list[str], bool, bool]:
    ids = draw(case.ids)
    skip_special_tokens = draw(st.booleans())
    text = case.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    cut = st.nothing()
    if text:
        cut = st.integers(0, len(text) - 1).flatmap(
            lambda i: st.integers(i + 1, min(len(text), i + 8)).map(lambda j: text[i:j]))
    stop = st.one_of(cut, case.random_stops)
    stops = draw(st.lists(stop, max_size=4))
    return ids, stops, skip_special_tokens, draw(st.booleans())


@functools.cache
def _generations(name: str) -> st.SearchStrategy[tuple[list[int], list[str], bool, bool]]:
    return generations(_case(name))


@pytest.mark.parametrize("name", ["default", "byte_level", "sentencepiece", "cleanup"])
@settings(max_examples=250, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_generations_build_the_reference_text(name: str, data: st.DataObject) -> None:
    ids, stops, skip_special_tokens, end_with_eos = data.draw(_generations(name))
    assert_same_as_reference(_case(name).tokenizer, ids, stops, skip_special_tokens=skip_special_tokens,
                             end_with_eos=end_with_eos)


# ---- the cases named -----------------------------------------------------------------------------


def _char_ids(text: str) -> list[int]:
    return default_tokenizer().encode(text, add_special_tokens=False)


def test_a_stop_string_across_several_tokens_ends_at_the_token_that_completes_it() -> None:
    ids = _char_ids("say hello world <tool_result>x</tool_result> and more")
    for stops in (["lo wo"], ["ult>x</too", "y h"], ["x</tool_result> a", "x<"], ["lo", "llo w", "l"]):
        assert_same_as_reference(default_tokenizer(), ids, stops, skip_special_tokens=True, end_with_eos=False)
    builder = _builder(default_tokenizer(), ["lo wo"], True, len(ids))
    for step in _steps(ids, False, 7):
        if builder.add(step):
            break
    assert builder.text == "say hel" and builder.stop_reason == "lo wo"
    assert builder.token_ids == ids[: len("say hello wo")]  # up to the token that completed it


def test_tokens_that_end_inside_a_character_are_held_until_it_is_whole() -> None:
    tokenizer = byte_level_tokenizer()
    euro = [tokenizer.backend.convert_tokens_to_ids(char) for char in byte_level_text("€")]
    ids = [*euro, *euro[:2], tokenizer.backend.convert_tokens_to_ids("a")]
    builder = _builder(tokenizer, [], True, len(ids))
    chunks = []
    for step in _steps(ids, False, 0):
        builder.add(step)
        chunk = builder.chunk()
        chunks.append(None if chunk is None else chunk["choices"][0]["text"])
    assert chunks == ["", "", "€", "", "", "\ufffda"]  # a character never completed is sent as U+FFFD
    assert builder.text == "€\ufffda"
    for stops in ([], ["\ufffd"], ["€"], ["\ufffda"]):
        assert_same_as_reference(tokenizer, ids, stops, skip_special_tokens=True, end_with_eos=True)


def test_a_decoder_that_changes_earlier_text_decodes_everything_and_stays_exact() -> None:
    tokenizer = cleanup_tokenizer()
    ids = tokenizer.encode("a . n't", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    for token in ids:
        detokenizer.add(token)
        assert detokenizer.text == tokenizer.decode(ids[: len(detokenizer._ids)])
    assert detokenizer.text == "a.n't" and detokenizer.full_decodes > 0


def test_text_from_the_end_reads_the_same_text_past_the_kept_pieces() -> None:
    tokenizer = default_tokenizer()
    ids = _char_ids("abcdefghij " * (RECENT_CHARS // 5))
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    for token in ids:
        detokenizer.add(token)
    text = tokenizer.decode(ids)
    assert len(detokenizer) == len(text) and detokenizer.text == text
    for start in (0, 1, len(text) - RECENT_CHARS, len(text) - KEPT_CHARS - 1, len(text) - KEPT_CHARS, len(text) - 1,
                  len(text), len(text) + 3):
        assert detokenizer.text_from(start) == text[start:]


# ---- cost ----------------------------------------------------------------------------------------


class CountingTokenizer:
    """The default tokenizer, counting the ids it is asked to decode."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self._tokenizer = tokenizer
        self.decoded_ids = 0
        self.eos_token_id = tokenizer.eos_token_id
        self.vocab_size = tokenizer.vocab_size

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        self.decoded_ids += len(ids)
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self._tokenizer.token_text(token_id)


def test_each_token_decodes_a_bounded_window_not_the_whole_reply() -> None:
    """Before: every token decoded all ids so far (n * (n + 1) / 2 = 2,001,000 ids for 2,000)."""
    counting = CountingTokenizer(default_tokenizer())
    ids = _char_ids("the quick brown fox jumps over the lazy dog. " * 45)[:2000]
    builder = _builder(counting, ["</tool_call>", "zzz"], True, len(ids))
    for step in _steps(ids, False, 7):
        builder.add(step)
        builder.chunk()
    assert builder.finish_reason == "length" and builder.text == default_tokenizer().decode(ids)
    assert counting.decoded_ids <= 24 * len(ids), counting.decoded_ids
