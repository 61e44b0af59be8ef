#!/usr/bin/env python
"""Build the embedded default model: a tiny character-level Llama trained from scratch.

Deterministic: every random choice comes from a fixed seed and training runs a fixed number of
steps (never a wall-clock budget).  Nothing is downloaded.  Steps:

1. build a character-level tokenizer (``tokenizers`` WordLevel over single characters) with the
   chat special tokens and the chat template;
2. generate synthetic calculator tool-use chats
   (``model_servers/inference_worker/default_model_data.py``);
3. train a 2-layer, hidden-64 ``LlamaForCausalLM`` (loss on assistant turns only);
4. evaluate two-turn greedy tool use on held-out problems;
5. save a Hugging Face model directory plus ``build_info.json`` and a model card.

Usage::

    .venv/bin/python scripts/build_default_model.py            # the shipped model
    .venv/bin/python scripts/build_default_model.py --steps 30 --out /tmp/m   # quick smoke run
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import transformers  # noqa: E402
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from model_servers.inference_worker import default_model_data as data  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "model_servers" / "inference_worker" / "default_model"
MAX_POSITIONS = 256

# Special tokens get ids 0..11 in this order; "\n" is 12, printable ASCII 32..126 are 13..107.
CHARS: tuple[str, ...] = ("\n", *(chr(i) for i in range(32, 127)))
# Role markers and framing tokens are "special" (dropped by skip_special_tokens=True); the
# tool-call / tool-result tags are plain added tokens so they survive skip_special_tokens=True.
NAMED_SPECIALS = {"pad_token": data.PAD, "bos_token": data.BOS, "unk_token": data.UNK, "eos_token": data.END}
ROLE_SPECIALS = (data.SYSTEM, data.USER, data.ASSISTANT, data.TOOL)
TAG_TOKENS = (data.TOOL_CALL_OPEN, data.TOOL_CALL_CLOSE, data.TOOL_RESULT_OPEN, data.TOOL_RESULT_CLOSE)

# The chat template (Jinja).  Output has no whitespace between parts; see default_model_data.py.
CHAT_TEMPLATE = (
    "{%- macro text(c) -%}"
    "{%- if c is string -%}{{ c }}"
    "{%- elif c is iterable -%}{%- for p in c -%}"
    "{%- if p is string -%}{{ p }}"
    "{%- elif p.text is defined and p.text is not none -%}{{ p.text }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{{- bos_token -}}"
    "{%- if tools -%}"
    "<|system|>{{ 'Tools: ' }}"
    "{%- for t in tools -%}"
    "{%- if t.function is defined -%}{{ t.function.name }}{%- else -%}{{ t.name }}{%- endif -%}"
    "{%- if not loop.last -%}{{ ', ' }}{%- endif -%}"
    "{%- endfor -%}"
    "<|end|>"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' or m.role == 'developer' -%}<|system|>{{ text(m.content) }}<|end|>"
    "{%- elif m.role == 'user' -%}<|user|>{{ text(m.content) }}<|end|>"
    "{%- elif m.role == 'assistant' -%}<|assistant|>{{ text(m.content) }}"
    "{%- if m.tool_calls is defined and m.tool_calls -%}"
    "{%- for tc in m.tool_calls -%}"
    "{%- set f = tc.function if tc.function is defined else tc -%}"
    '<tool_call>{"name":{{ f.name | tojson }},"arguments":'
    "{%- if f.arguments is string -%}{{ f.arguments }}"
    "{%- else -%}{{ f.arguments | tojson(separators=(',', ':')) }}{%- endif -%}"
    "}</tool_call>"
    "{%- endfor -%}"
    "{%- endif -%}"
    "<|end|>"
    "{%- elif m.role == 'tool' -%}<|tool|><tool_result>{{ text(m.content) }}</tool_result><|end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------
def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab: dict[str, int] = {}
    for piece in (*data.SPECIAL_TOKENS, *CHARS):
        vocab[piece] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=data.UNK))
    # one "word" per character (newline included); no normalizer, no post-processor (no auto <bos>)
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    specials = [*NAMED_SPECIALS.values(), *ROLE_SPECIALS]
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in data.SPECIAL_TOKENS if t in specials]
    )
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        **NAMED_SPECIALS,
        extra_special_tokens=list(ROLE_SPECIALS),
        clean_up_tokenization_spaces=False,
        model_max_length=MAX_POSITIONS,
        padding_side="left",
    )
    tok.chat_template = CHAT_TEMPLATE
    for i, t in enumerate(data.SPECIAL_TOKENS):
        assert tok.convert_tokens_to_ids(t) == i, (t, tok.convert_tokens_to_ids(t))
    assert len(tok) == len(data.SPECIAL_TOKENS) + len(CHARS)
    return tok


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------
def make_training_set(tok: PreTrainedTokenizerFast, n: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    problems = [data.make_problem(rng) for _ in range(n)]
    texts = [data.render_example(p) for p in problems]
    encs = tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    lengths = torch.tensor([len(e.ids) for e in encs], dtype=torch.int32)
    max_len = int(lengths.max())
    assert max_len <= MAX_POSITIONS, max_len
    ids = torch.full((n, max_len), tok.pad_token_id, dtype=torch.int16)
    for i, e in enumerate(encs):
        ids[i, : len(e.ids)] = torch.tensor(e.ids, dtype=torch.int16)
    mask = assistant_loss_mask(ids.long(), tok)
    digest = hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:16]
    return {
        "ids": ids,
        "mask": mask,
        "lengths": lengths,
        "questions": {p["question"] for p in problems},
        "hash": digest,
        "mean_len": float(lengths.float().mean()),
        "max_len": max_len,
    }


def assistant_loss_mask(ids: torch.Tensor, tok: PreTrainedTokenizerFast) -> torch.Tensor:
    """True for tokens inside assistant turns (after ``<|assistant|>``, up to and including ``<|end|>``)."""
    role_ids = torch.tensor([tok.convert_tokens_to_ids(t) for t in ROLE_SPECIALS])
    assistant_id = tok.convert_tokens_to_ids(data.ASSISTANT)
    is_role = torch.isin(ids, role_ids)
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    last_role = torch.where(is_role, pos, torch.full_like(pos, -1)).cummax(dim=1).values
    current = torch.gather(ids, 1, last_role.clamp(min=0))
    return (last_role >= 0) & (current == assistant_id) & ~is_role & (ids != tok.pad_token_id)


def make_batches(lengths: torch.Tensor, batch: int, bucket: int, steps: int, seed: int) -> list[torch.Tensor]:
    rng = random.Random(seed)
    n = lengths.shape[0]
    per = batch * bucket
    out: list[torch.Tensor] = []
    start = 0
    while len(out) < steps:
        if start + per > n:
            start = 0  # wrap (only if --train-examples is smaller than steps * batch)
        idx = torch.arange(start, start + per)
        start += per
        idx = idx[torch.argsort(lengths[idx], stable=True)]
        group = [idx[i * batch : (i + 1) * batch] for i in range(bucket)]
        rng.shuffle(group)
        out.extend(group)
    return out[:steps]


# ----------------------------------------------------------------------------------------------
# Model and training
# ----------------------------------------------------------------------------------------------
def build_model(tok: PreTrainedTokenizerFast, args: argparse.Namespace) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)  # attention: sdpa (the default on CPU)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        do_sample=False,
    )
    return model


def lr_at(step: int, steps: int, peak: float, warmup: int, floor: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(model: LlamaForCausalLM, train_set: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.98),
        eps=1e-8,
    )
    batches = make_batches(train_set["lengths"], args.batch, args.bucket, args.steps, args.seed + 1)
    ids_all, mask_all, lengths = train_set["ids"], train_set["mask"], train_set["lengths"]
    model.train()
    t0 = time.perf_counter()
    window: list[float] = []
    history: list[dict[str, float]] = []
    tokens_seen = 0
    for step, idx in enumerate(batches):
        lr = lr_at(step, args.steps, args.lr, args.warmup, args.lr_floor)
        for g in opt.param_groups:
            g["lr"] = lr
        width = int(lengths[idx].max())
        ids = ids_all[idx, :width].long()
        mask = mask_all[idx, :width]
        tokens_seen += ids.numel()
        # right padding + causal attention: real tokens never attend to padding, so no mask needed
        logits = model(input_ids=ids).logits[:, :-1]
        target = ids[:, 1:].masked_fill(~mask[:, 1:], -100)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), ignore_index=-100
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        window.append(loss.item())
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            elapsed = time.perf_counter() - t0
            avg = sum(window) / len(window)
            history.append({"step": step + 1, "loss": round(avg, 5), "elapsed_s": round(elapsed, 1)})
            print(
                f"step {step + 1:5d}/{args.steps}  loss {avg:.4f}  lr {lr:.2e}  "
                f"{elapsed:7.1f}s  {(step + 1) / elapsed:.2f} step/s",
                flush=True,
            )
            window = []
    model.eval()
    elapsed = time.perf_counter() - t0
    return {
        "train_seconds": round(elapsed, 1),
        "final_loss": history[-1]["loss"],
        "loss_history": history,
        "tokens_seen_padded": tokens_seen,
    }


# ----------------------------------------------------------------------------------------------
# Evaluation: two-turn greedy tool use
# ----------------------------------------------------------------------------------------------
def heldout_problems(n: int, seed: int, exclude: set[str]) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    while len(out) < n:
        p = data.make_problem(rng)
        if p["question"] in exclude or p["question"] in seen:
            continue
        seen.add(p["question"])
        out.append(p)
    return out


@torch.no_grad()
def greedy_batch(
    model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, prompts: list[list[int]], max_new: int
) -> list[tuple[list[int], bool]]:
    """Greedy-generate for each prompt; returns (generated ids up to and including eos, hit_eos)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tok.pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        attn[i, width - len(p) :] = 1
    out = model.generate(
        input_ids=ids,
        attention_mask=attn,
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    results = []
    for row in out[:, width:].tolist():
        if tok.eos_token_id in row:
            k = row.index(tok.eos_token_id)
            results.append((row[: k + 1], True))
        else:
            results.append((row, False))
    return results


def evaluate(
    model: LlamaForCausalLM,
    tok: PreTrainedTokenizerFast,
    problems: list[dict[str, Any]],
    batch: int = 100,
) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for start in range(0, len(problems), batch):
        chunk = problems[start : start + batch]
        prompts = [tok.encode(data.render_prompt(p), add_special_tokens=False) for p in chunk]
        turn1 = greedy_batch(model, tok, prompts, max_new=80)
        second: list[int] = []
        second_prompts: list[list[int]] = []
        for i, (p, (gen, hit_eos)) in enumerate(zip(chunk, turn1, strict=True)):
            text = str(tok.decode(gen, skip_special_tokens=False))
            calls = data.parse_tool_calls(text) if hit_eos else None
            ok_form = calls is not None and len(calls) == 1
            call = calls[0] if ok_form and calls else None
            row = {
                "question": p["question"],
                "tool": p["tool"],
                "template": p["template"],
                "call_text": text,
                "well_formed": ok_form,
                "call_correct": bool(
                    call and call["name"] == p["tool"] and call["arguments"] == p["arguments"]
                ),
                "final_text": None,
                "final_correct": False,
                "copies_result": False,
            }
            rows.append(row)
            if call is None:
                continue
            try:
                result = data.run_tool(call["name"], call["arguments"])
            except (KeyError, TypeError):
                continue
            row["result"] = result
            second.append(len(rows) - 1)
            second_prompts.append(
                prompts[i] + gen + tok.encode(data.render_tool_result(result), add_special_tokens=False)
            )
        if second_prompts:
            turn2 = greedy_batch(model, tok, second_prompts, max_new=40)
            for r, (gen, hit_eos) in zip(second, turn2, strict=True):
                row = rows[r]
                text = str(tok.decode(gen, skip_special_tokens=False))
                row["final_text"] = text
                answer = problems[r]["answer"]
                row["final_correct"] = hit_eos and text == data.final_answer_text(answer) + data.END
                row["copies_result"] = hit_eos and text == data.final_answer_text(row["result"]) + data.END

    def pct(key: str, subset: list[dict[str, Any]]) -> float:
        return round(100.0 * sum(bool(r[key]) for r in subset) / max(1, len(subset)), 1)

    by_tool = {
        name: {
            "n": len([r for r in rows if r["tool"] == name]),
            "final_correct": sum(r["final_correct"] for r in rows if r["tool"] == name),
        }
        for name in data.TOOL_NAMES
    }
    return {
        "n": len(rows),
        "well_formed_pct": pct("well_formed", rows),
        "call_correct_pct": pct("call_correct", rows),
        "final_correct_pct": pct("final_correct", rows),
        "copies_result_pct": pct("copies_result", rows),
        "by_tool": by_tool,
        "failures": [r for r in rows if not r["final_correct"]][:20],
    }


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------
def write_model_card(out: Path, info: dict[str, Any]) -> None:
    ev = info["eval"]
    cfg = info["model"]
    tr = info["training"]
    by_tool = ", ".join(f"{name} {v['final_correct']}/{v['n']}" for name, v in ev["by_tool"].items())
    example = data.render_example(
        {
            "question": "What is 97 times 53?",
            "tool": "multiply",
            "arguments": {"a": 97, "b": 53},
            "answer": 5141,
        }
    )
    notes = "".join(f"\n  - {n}" for n in info.get("notes", []))
    special = ", ".join(f"`{t}`={i}" for i, t in enumerate(data.SPECIAL_TOKENS))
    card = f"""# Embedded default model (tiny calculator tool-use Llama)

The offline default model of the `transformers` engine of `inference_worker`. It was trained from
scratch on synthetic data by `scripts/build_default_model.py`. No pretrained weights are involved,
and nothing is downloaded. It is a test fixture for the mesh. It is not a useful language model:
it can only answer add/subtract/multiply word problems by calling a calculator tool.

## Architecture
- `LlamaForCausalLM` with {cfg["layers"]} layers, hidden size {cfg["hidden"]}, {cfg["heads"]} attention heads
  ({cfg["kv_heads"]} KV heads), intermediate size {cfg["hidden"] * 4}, and tied input/output embeddings.
- RoPE positions, `max_position_embeddings` {MAX_POSITIONS}.
- {cfg["params"]:,} parameters, fp32. `model.safetensors` is {cfg["safetensors_bytes"]:,} bytes.
- Tokenizer: character level, {cfg["vocab"]} ids. It is a `tokenizers` WordLevel model with one token per
  character: `\\n` plus printable ASCII 32..126. Other characters map to `<unk>`.
  - Special tokens: {special}. `\\n` is id 12, and ASCII character c is id c - 19.
  - The tokenizer does not add `<bos>` by itself. The chat template writes it.
  - `<tool_call>`, `</tool_call>`, `<tool_result>` and `</tool_result>` are added tokens but not
    special tokens, so `decode(..., skip_special_tokens=True)` keeps them.
  - The decoder fuses characters. `decode(ids, skip_special_tokens=False)` gives back the exact text.
- The model stops by emitting `<|end|>` (eos_token_id {info["tokenizer"]["eos_token_id"]}).

## Chat format
The chat template is in `tokenizer_config.json`. There is no whitespace between the parts:

```
{example}
```

- The tool list becomes `<|system|>Tools: name1, name2<|end|>`.
- Tool calls are written as compact JSON with the key `name` first, then `arguments`.
- The generation prompt is `<|assistant|>`.

## Training
- Data: {tr["examples"]:,} synthetic chats from `default_model_data.make_problem`, seeded with
  `random.Random({info["seed"]})`.
  - There are {data.NUM_TEMPLATES} question templates: 7 add, 5 subtract (b <= a) and 6 multiply.
  - Each question uses 12 names and 16 item nouns.
  - Add and subtract numbers are 0..{data.ADD_MAX}; multiply numbers are 0..{data.MULTIPLY_MAX}.
  - Mean length is {tr["mean_len"]:.0f} tokens, maximum {tr["max_len"]}.
  - Each example is seen once.
- Loss is taken only on the assistant turns: the tool-call turn and the final-answer turn, each
  including its `<|end|>`.
- Optimizer: AdamW, peak learning rate {tr["lr"]}, betas (0.9, 0.98), weight decay {tr["weight_decay"]} on
  matrices, gradient clipping {tr["clip"]}.
- Schedule: {tr["warmup"]}-step linear warmup, then cosine decay to {tr["lr_floor"]:.0%} of the peak.
- Batches: {tr["batch"]} sequences each, bucketed by length ({tr["bucket"]} batches are sorted together).
- **{tr["steps"]:,} steps** (fixed; there is no time budget). The final training loss (mean of the last
  {tr["log_every"]} steps) is {tr["final_loss"]:.4f}.
- Training took {tr["train_seconds"]:.0f} s ({tr["train_seconds"] / 60:.1f} min) on {info["machine"]},
  which was shared with other work. It ran in fp32 with torch threads = {info["threads"]}, torch
  {info["versions"]["torch"]} and transformers {info["versions"]["transformers"]}. The whole build, including
  data generation and evaluation, took {info["elapsed_seconds"]:.0f} s.
  - One thread and two threads gave bit-identical weights in a 100-step check. One thread is the
    default because two threads slow down badly when the two cores are shared.
  - Denormal floats are flushed to zero during training.
  - Speed: with one thread and no other training beside it, this machine runs about 7.4 steps/s,
    so 8,000 steps take about 18 min.{notes}

## Measured held-out accuracy
The test set is {ev["n"]} problems from seed {info["eval_seed"]}. Any question text that also appears
in training is excluded. Decoding is greedy and has two turns:
1. The model generates the call.
2. Python runs the tool and appends `<|tool|><tool_result>R</tool_result><|end|><|assistant|>`.
3. The model generates the answer, stopping at `<|end|>`.

| Metric | Value |
|---|---|
| Well-formed tool calls | {ev["well_formed_pct"]:.1f}% |
| Tool and arguments correct | {ev["call_correct_pct"]:.1f}% |
| Final answer correct (exactly `The answer is N.`) | {ev["final_correct_pct"]:.1f}% |
| Final answer copies the tool result | {ev["copies_result_pct"]:.1f}% |

Final answers correct, by operation: {by_tool}.

The remaining failures are almost all in turn 1: a number is copied from the question with a
digit dropped, changed or transposed (for example 522 becomes 52). The final answer copies the tool
result {ev["copies_result_pct"]:.1f}% of the time. The held-out set leans towards the
templates with names and items. Short questions such as "What is 5 times 7?" are mostly excluded,
because their text also appears in the training data.

## Limits (for servers using this model)
- The model was trained only with the tool list `add, subtract, multiply`, one user question and
  no system message. Any other input is out of distribution; it may still produce a well-formed
  `<tool_call>`, but nothing more is promised.
- Keep the prompt plus the generation within {MAX_POSITIONS} tokens. The longest training example is
  {tr["max_len"]} tokens.
- The chat template copies a string `arguments` field as it is. To match the training text, pass
  compact JSON (`{{"a":1,"b":2}}`) or a dict (the template dumps a dict compactly).
- `generation_config.json` sets no length limit. Pass `max_new_tokens` yourself: 80 is plenty for
  a call and 40 for an answer.

## Rebuild
```
.venv/bin/python scripts/build_default_model.py --steps {tr["steps"]}   # writes this directory
.venv/bin/python scripts/build_default_model.py --steps 30 --out /tmp/smoke
```
The build is deterministic. The same seed and step count on the same torch build give the same
data and the same weights. `build_info.json` records:
- the seed and step count;
- the data hash `{tr["data_hash"]}`;
- the losses;
- the evaluation numbers;
- the elapsed seconds;
- the sha256 of `model.safetensors`.
"""
    (out / "README.md").write_text(card)


def save(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    # chat template inside tokenizer_config.json (not a separate chat_template.jinja)
    tok.save_pretrained(out, save_jinja_files=False)
    stale = out / "chat_template.jinja"
    if stale.exists():
        stale.unlink()
    # transformers 5 writes its internal class name; the generic alias also loads in transformers 4
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    for f in out.iterdir():
        if f.is_file():
            f.chmod(0o644)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--steps", type=int, default=8000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-seed", type=int, default=12345)
    ap.add_argument("--eval-n", type=int, default=300)
    ap.add_argument("--train-examples", type=int, default=0, help="0 = steps * batch (each example once)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--bucket", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--lr-floor", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="1: same bits as 2, and robust on a shared CPU")
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--note", action="append", default=[], help="free-text note for build_info and the card")
    ap.add_argument(
        "--card-only", action="store_true", help="only rewrite README.md from <out>/build_info.json"
    )
    args = ap.parse_args(argv)
    if args.card_only:
        write_model_card(args.out, json.loads((args.out / "build_info.json").read_text()))
        return 0

    t_start = time.perf_counter()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    # Tokens that never occur (most of printable ASCII) get vanishing gradients through the tied
    # output embedding; Adam's second moment of those rows falls into the denormal range and makes
    # every step several times slower on x86.  Flushing denormals to zero avoids that.
    torch.set_flush_denormal(True)
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    tok = build_tokenizer()
    n_train = args.train_examples or args.steps * args.batch
    n_train = max(n_train, args.batch * args.bucket)
    t0 = time.perf_counter()
    train_set = make_training_set(tok, n_train, args.seed)
    print(
        f"data: {n_train} examples, mean {train_set['mean_len']:.1f} / max {train_set['max_len']} tokens, "
        f"hash {train_set['hash']} ({time.perf_counter() - t0:.1f}s)",
        flush=True,
    )

    model = build_model(tok, args)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {args.layers}L h{args.hidden} {args.heads} heads, {n_params:,} params; "
        f"training {args.steps} steps x {args.batch}",
        flush=True,
    )
    stats = train(model, train_set, args)

    t0 = time.perf_counter()
    problems = heldout_problems(args.eval_n, args.eval_seed, train_set["questions"])
    ev = evaluate(model, tok, problems)
    eval_seconds = time.perf_counter() - t0

    save(model, tok, args.out)
    weights = args.out / "model.safetensors"
    info = {
        "seed": args.seed,
        "eval_seed": args.eval_seed,
        "threads": args.threads,
        "machine": f"{os.cpu_count()} CPU cores ({platform.machine()})",
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "model": {
            "layers": args.layers,
            "hidden": args.hidden,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "vocab": len(tok),
            "params": n_params,
            "safetensors_bytes": weights.stat().st_size,
            "safetensors_sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
        },
        "tokenizer": {
            "special_token_ids": {t: i for i, t in enumerate(data.SPECIAL_TOKENS)},
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
            "bos_token_id": tok.bos_token_id,
        },
        "training": {
            "steps": args.steps,
            "batch": args.batch,
            "bucket": args.bucket,
            "examples": n_train,
            "lr": args.lr,
            "lr_floor": args.lr_floor,
            "warmup": args.warmup,
            "weight_decay": args.weight_decay,
            "clip": args.clip,
            "log_every": args.log_every,
            "data_hash": train_set["hash"],
            "mean_len": train_set["mean_len"],
            "max_len": train_set["max_len"],
            **stats,
        },
        "eval": {k: v for k, v in ev.items() if k != "failures"},
        "eval_seconds": round(eval_seconds, 1),
        "elapsed_seconds": round(time.perf_counter() - t_start, 1),
        "notes": args.note,
    }
    (args.out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    write_model_card(args.out, info)

    print()
    print(f"held-out evaluation ({ev['n']} problems, greedy, two turns)")
    print(f"  {'well-formed tool calls':<28}{ev['well_formed_pct']:6.1f}%")
    print(f"  {'tool+args correct':<28}{ev['call_correct_pct']:6.1f}%")
    print(f"  {'final answer correct':<28}{ev['final_correct_pct']:6.1f}%")
    print(f"  {'final copies tool result':<28}{ev['copies_result_pct']:6.1f}%")
    for name, v in ev["by_tool"].items():
        print(f"    {name:<12}{v['final_correct']}/{v['n']}")
    for r in ev["failures"][:8]:
        print(f"  FAIL [{r['template']}] {r['question']!r} -> {r['call_text']!r} -> {r['final_text']!r}")
    print(
        f"train {stats['train_seconds']:.0f}s, eval {eval_seconds:.1f}s, "
        f"total {info['elapsed_seconds']:.0f}s; saved to {args.out} "
        f"({info['model']['safetensors_bytes']:,} B weights)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
