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
import glob
import hashlib
import json
import math
import os
import queue
import shutil
import signal
import sys
import threading
import time
import traceback
from contextlib import nullcontext

import numpy as np
import torch

import dflash_model as dm
from scripts.builtin_assets import BUILTIN_DATA, BUILTIN_MODEL, builtin_data_file, builtin_model_dir

# -----------------------------------------------------------------------------
# Command line

DEFAULT_MODEL, DEFAULT_DATA = BUILTIN_MODEL, BUILTIN_DATA


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--target-model", default=DEFAULT_MODEL, help="transformers model id or local directory (decoder-only causal LM)")
    a("--data", nargs="+", default=[DEFAULT_DATA], help="JSONL files or globs (messages, conversations, or input_ids+loss_mask)")
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
    a("--mask-token-id", type=int, default=None, help="default: the first embedding row the tokenizer does not use")
    a("--lr", type=float, default=6e-4)
    a("--warmup-ratio", type=float, default=0.04)
    a("--weight-decay", type=float, default=0.0)
    a("--epochs", type=float, default=6)
    a("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    a("--grad-clip", type=float, default=1.0)
    a("--loss-decay-gamma", type=float, default=None, help="default: 7 for block 16, 5 for 10, 4 for 8")
    a("--ce-chunk-size", type=int, default=4096, help="draft positions per LM-head/CE chunk (bounds logits memory)")
    a("--seed", type=int, default=0)
    a("--log-interval", type=int, default=10)
    a("--save-interval", type=int, default=1000)
    a("--keep-checkpoints", type=int, default=3)
    a("--resume", default=None, help="a checkpoint directory, or 'auto' for the latest in --output-dir")
    a("--compile", action="store_true", help="compile each drafter step and replay it as one CUDA graph")
    a("--queue-depth", type=int, default=2, help="batches waiting per drafter worker")
    a("--switch-interval", type=float, default=1e-4,
      help="Python thread switch interval (s) on GPU runs: short, so workers are not kept waiting")
    a("--dist-timeout", type=float, default=1800,
      help="several machines (torchrun): seconds a machine waits for the others before the run stops")
    a("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "dflash_train"))
    a("--eval-data", default=None, help="held-out prompts (JSONL) for the final acceptance-length measurement; "
      "the built-in demo uses MT-Bench")
    a("--eval-interval", type=int, default=0,
      help="every N steps, measure the real acceptance length on the held-out prompts and log it next to tau_hat")
    a("--eval-prompts", type=int, default=8, help="how many held-out prompts to evaluate at the end (0: none)")
    a("--eval-max-new-tokens", type=int, default=64)
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
    for name in ("lr", "epochs", "log_interval", "save_interval", "queue_depth", "ce_chunk_size"):
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
# Data: JSONL rows -> token ids + loss mask (cached) -> packed fixed-shape batches

ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system"}


class BadRow(Exception):
    pass


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


def render_chat(tokenizer, messages, add_generation_prompt=False):
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def tokenize_conversation(tokenizer, messages):
    """Token ids of the chat-templated conversation, and a mask of the assistant tokens.

    Assistant spans are found on the rendered text (prefix with generation prompt -> prefix with
    the reply), then mapped to tokens through the offsets, so any chat template works."""
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"{tokenizer.name_or_path}: the tokenizer has no chat template; use a chat model or "
                         "pre-tokenised rows (input_ids + loss_mask)")
    text = render_chat(tokenizer, messages)
    spans, search_from = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render_chat(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        upto = render_chat(tokenizer, messages[:i + 1])
        if text.startswith(upto) and upto.startswith(before):
            spans.append((len(before), len(upto)))
        else:  # templates that rewrite earlier turns: locate the reply text itself
            start = text.find(m["content"], search_from)
            if start < 0:
                continue
            spans.append((start, start + len(m["content"])))
        search_from = spans[-1][1]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(s < e2 and e > s2 for s2, e2 in spans) if e > s else any(s2 <= s < e2 for s2, e2 in spans))
            for s, e in enc["offset_mapping"]]
    return enc["input_ids"], mask


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


def corpus_cache_key(paths, tokenizer, max_length, vocab_size):
    h = hashlib.sha256()
    for p in paths:
        st = os.stat(p)
        h.update(f"{os.path.abspath(p)}|{st.st_size}|{st.st_mtime_ns}".encode())
    h.update(f"{tokenizer.name_or_path}|{len(tokenizer)}|{tokenizer.chat_template}|{max_length}|{vocab_size}|v1".encode())
    return h.hexdigest()[:20]


def load_corpus(paths, tokenizer, max_length, vocab_size, cache_dir, log=print, max_bad_fraction=0.5):
    """Read, validate, tokenise and truncate every row; skipped rows are named and counted."""
    key = corpus_cache_key(paths, tokenizer, max_length, vocab_size)
    cache_file = os.path.join(cache_dir, f"corpus_{key}.npz")
    if os.path.exists(cache_file):
        z = np.load(cache_file, allow_pickle=False)
        stats = json.loads(str(z["stats"]))
        log(f"data: {len(z['offsets']) - 1} documents from cache {cache_file}")
        return Corpus(z["ids"], z["mask"], z["offsets"], stats)

    ids, mask, offsets = [], [], [0]
    stats = {"rows": 0, "documents": 0, "truncated": 0, "skipped": {}}
    shown = 0

    def skip(path, lineno, why):
        nonlocal shown
        kind = why.split(":")[0] if ":" in why else why
        stats["skipped"][kind] = stats["skipped"].get(kind, 0) + 1
        if shown < 20:
            log(f"warning: skipping {path}:{lineno}: {why}")
            shown += 1

    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                stats["rows"] += 1
                try:
                    row = json.loads(line)
                    if not isinstance(row, dict):
                        raise BadRow("not a JSON object")
                    if "input_ids" in row:
                        t, m = row["input_ids"], row.get("loss_mask")
                        if m is None or len(m) != len(t) or not t:
                            raise BadRow("input_ids needs a loss_mask of the same length")
                        if min(t) < 0 or max(t) >= vocab_size:
                            raise BadRow("input_ids outside the target vocabulary")
                    else:
                        t, m = tokenize_conversation(tokenizer, row_to_messages(row))
                except json.JSONDecodeError as e:
                    skip(path, lineno, f"bad JSON: {e.msg}")
                    continue
                except BadRow as e:
                    skip(path, lineno, str(e))
                    continue
                if len(t) > max_length:
                    stats["truncated"] += 1
                    t, m = t[:max_length], m[:max_length]
                if sum(m) < 2:
                    skip(path, lineno, "no assistant tokens (after truncation)")
                    continue
                ids.append(np.asarray(t, dtype=np.int32))
                mask.append(np.asarray(m, dtype=np.uint8))
                offsets.append(offsets[-1] + len(t))
    stats["documents"] = len(ids)
    n_skipped = sum(stats["skipped"].values())
    if not ids:
        raise UsageError(f"--data: no usable documents in {paths} ({n_skipped} rows skipped: {stats['skipped']})")
    if n_skipped > max_bad_fraction * stats["rows"]:
        raise UsageError(f"--data: {n_skipped} of {stats['rows']} rows are malformed ({stats['skipped']}); "
                         "check the format (messages / conversations / input_ids+loss_mask)")
    corpus = Corpus(np.concatenate(ids), np.concatenate(mask), np.asarray(offsets, dtype=np.int64), stats)
    os.makedirs(cache_dir, exist_ok=True)
    tmp = cache_file + f".tmp{os.getpid()}.npz"
    np.savez(tmp, ids=corpus.ids, mask=corpus.mask, offsets=corpus.offsets, stats=json.dumps(stats))
    os.replace(tmp, cache_file)
    log(f"data: {stats['documents']} documents from {stats['rows']} rows, {stats['truncated']} truncated, "
        f"skipped {stats['skipped'] or 'none'}; cached at {cache_file}")
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


class BatchStream:
    """The endless, deterministic sequence of batches: epoch by epoch, rows_per_batch rows each.
    Batch k of the run is the same in every run with the same seed, so resuming skips k batches."""

    def __init__(self, corpus, rows_per_batch, max_length, seed):
        self.corpus, self.rows_per_batch, self.max_length, self.seed = corpus, rows_per_batch, max_length, seed
        first = pack_epoch(corpus.lengths, max_length, seed, 0)
        self.batches_per_epoch = max(1, len(first) // rows_per_batch)
        real = int(corpus.lengths.sum())
        self.packing_efficiency = real / (len(first) * max_length)

    def iterate(self, skip, round_size=1, mine=range(1)):
        """Batches from number `skip` on. Batch g is position g % round_size of its step's round;
        only positions in `mine` are built (over several machines, each builds its own slice)."""
        epoch, k = skip // self.batches_per_epoch, skip % self.batches_per_epoch
        while True:
            rows = pack_epoch(self.corpus.lengths, self.max_length, self.seed, epoch)
            # Epochs pack into slightly different row counts: cycle rows so every batch is full.
            need = self.batches_per_epoch * self.rows_per_batch
            rows = (rows * math.ceil(need / len(rows)))[:need]
            for i in range(k, self.batches_per_epoch):
                if (epoch * self.batches_per_epoch + i) % round_size in mine:
                    yield epoch, make_batch(self.corpus, rows[i * self.rows_per_batch:(i + 1) * self.rows_per_batch],
                                            self.max_length)
            epoch, k = epoch + 1, 0


# -----------------------------------------------------------------------------
# Target stage: frozen replicas, only as deep as the deepest captured layer, no LM head

def document_causal_mask(doc_ids, dtype):
    """Additive [R, 1, L, L] mask: causal and within one document (packed documents are
    independent). A finite minimum keeps padding rows free of NaN."""
    L = doc_ids.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=doc_ids.device).tril()
    allowed = causal & (doc_ids[:, :, None] == doc_ids[:, None, :])
    mask = torch.zeros(allowed.shape, dtype=dtype, device=doc_ids.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


TARGET_INPUTS = ("input_ids", "position_ids", "doc_ids")  # what the target stage reads of a batch


class TargetReplica:
    """A frozen target on one device. With --compile its fixed-shape forward is captured once
    as a CUDA graph, so the main thread issues a few calls per batch instead of thousands."""

    def __init__(self, model, layer_ids, device):
        self.model, self.layer_ids, self.device = model, layer_ids, device
        self.dtype = next(model.parameters()).dtype
        self.graph, self.static_in, self.static_out = None, None, None

    def forward(self, input_ids, position_ids, doc_ids):
        """Concatenated outputs of the captured layers, [R, L, n*H]."""
        mask = document_causal_mask(doc_ids, self.dtype)
        base = getattr(self.model, self.model.base_model_prefix)
        with dm.capture_layer_outputs(self.model, self.layer_ids) as outs:
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


def load_target(name, devices, layer_ids, log=print):
    """One frozen replica per target device, truncated after the deepest captured layer."""
    from transformers import AutoModelForCausalLM
    dtype = torch.bfloat16 if devices[0].type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(name), dtype=dtype, attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    n_layers = len(dm.decoder_layers(model))
    keep = max(layer_ids) + 1
    getattr(model, model.base_model_prefix).layers = dm.decoder_layers(model)[:keep]
    # The drafters use the target's embedding and LM head; keep a CPU copy, drop the head here.
    embed = model.get_input_embeddings().weight.detach().clone()
    head = model.get_output_embeddings().weight.detach().clone()
    replicas = []
    for i, dev in enumerate(devices):
        replica = model if i == len(devices) - 1 else copy.deepcopy(model)
        replicas.append(TargetReplica(replica.to(dev), layer_ids, dev))
    log(f"target: {type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters; "
        f"running {keep} of {n_layers} layers on {[str(d) for d in devices]} in {dtype}")
    return replicas, embed, head


def resolve_model_path(name):
    if name.startswith("builtin:"):
        return builtin_model_dir(name)
    return name


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
    any machine (a signal) ends every machine's run after the same step."""

    def __init__(self, num_workers, cluster=None, stop_requested=lambda: False):
        self.num_workers, self.cluster = num_workers, cluster or Cluster()
        self.active = num_workers > 1 or self.cluster.world_size > 1  # is there anything to average
        self.stop_requested, self.stop_agreed = stop_requested, False
        self.buffers = [None] * num_workers
        self.barrier = threading.Barrier(num_workers, action=self._average) if num_workers > 1 else None

    def _average(self):
        buffers, first = self.buffers, self.buffers[0]
        # One GPU per worker: one NCCL all-reduce, every GPU's links busy at once (2 x 4.2 GB:
        # 14 ms against 30 ms through the first GPU; docs/benchmarks.md, third session).
        nccl = len(buffers) > 1 and all(b.is_cuda for b in buffers) and torch.cuda.nccl.is_available(buffers)
        if nccl:
            torch.cuda.nccl.all_reduce(buffers)  # in place: every buffer holds this machine's sum
        else:
            for b in buffers[1:]:
                first += b.to(first.device)
        if self.cluster.world_size > 1:
            # One slot more than the gradients: the stop vote rides in the same reduction.
            total = torch.cat([first, first.new_tensor([float(self.stop_requested())])])
            self.cluster.all_reduce_(total)
            first.copy_(total[:-1])
            self.stop_agreed = bool(total[-1] > 0)
        count = self.num_workers * self.cluster.world_size
        if nccl and self.cluster.world_size == 1:
            for b in buffers:
                b /= count
        else:
            first /= count
            for b in buffers[1:]:
                b.copy_(first)
        for b in buffers:
            if b.is_cuda:
                torch.cuda.synchronize(b.device)

    def average(self, rank, flat_grad):
        if not self.active:
            return
        if flat_grad.device.type == "cuda":
            torch.cuda.current_stream(flat_grad.device).synchronize()
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

def lr_at(step, total_steps, warmup_steps, peak):
    """Linear warmup, then cosine to zero. step counts from 1."""
    if step <= warmup_steps:
        return peak * step / max(1, warmup_steps)
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


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
        # All gradients are views of one flat buffer: averaging and clipping are one op each.
        self.flat_grad = torch.zeros(sum(p.numel() for p in params), device=device, dtype=torch.float32)
        at = 0
        for p in params:
            p.grad = self.flat_grad[at:at + p.numel()].view_as(p)
            at += p.numel()
        cuda = device.type == "cuda"
        # A tensor learning rate, so a captured optimizer step reads the scheduled value.
        self.lr = torch.tensor(args.lr, device=device) if cuda else args.lr
        # On CUDA the fused kernel: 8.4 ms per step at 1.05B parameters against 32.6 ms for the
        # foreach one (docs/benchmarks.md, third session); capturable, so it lives in the graph.
        self.optimizer = torch.optim.AdamW(params, lr=self.lr, weight_decay=args.weight_decay,
                                           **(dict(fused=True, capturable=True) if cuda else dict(foreach=True)))
        self.generator = torch.Generator(device=device)
        if args.compile:
            compile_every_worker_or_fail()
        self.loss_fn = torch.compile(self.compute_loss, fullgraph=True, dynamic=False) if args.compile \
            else self.compute_loss
        self.graphs, self.static, self.static_out = None, None, None
        self.stats, self.losses, self.steps_done = None, [], 0
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.main, name=f"drafter-{rank}", daemon=True)

    # --- the step ---------------------------------------------------------------------------

    def compute_loss(self, features, input_ids, loss_mask, doc_ids, position_ids, anchor_noise):
        a = self.args
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False) if self.device.type == "cuda" \
                else nullcontext():
            return self.drafter(features, input_ids, loss_mask, doc_ids, position_ids, anchor_noise,
                                num_anchors=a.num_anchors, gamma=a.loss_decay_gamma,
                                ce_chunk_size=a.ce_chunk_size, attention=a.attention)

    def forward_backward(self, inputs):
        self.flat_grad.zero_()
        loss, stats = self.loss_fn(*inputs)
        loss.backward()
        return loss.detach(), stats

    def clip_and_update(self):
        grad_norm = self.flat_grad.norm()
        self.flat_grad.mul_(torch.clamp(self.args.grad_clip / (grad_norm + 1e-6), max=1.0))
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
            self.lr.fill_(self.run.lr_at(step))
        else:
            self.optimizer.param_groups[0]["lr"] = self.run.lr_at(step)

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
        vocab = self.drafter.embed_weight.shape[0]
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
            saved = [(t, t.clone()) for t in state_tensors()] + [(p, p.detach().clone()) for p in self.drafter.parameters()]
            fresh = not self.optimizer.state
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
            if fresh:  # the warm-up created the optimizer state: back to zero moments and step 0
                for t in state_tensors():
                    t.zero_()
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
        step = self.run.start_step
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
            loss, stats = self.train_step(step, batch)
            self.stats = stats if self.stats is None else self.stats + stats
            self.losses.append(loss)
            self.steps_done = step
            self.run.step_done(self, step)
            if self.averager.stop_agreed:  # another machine was signalled: every machine ends after this step
                self.run.interrupted = True
                return

# -----------------------------------------------------------------------------
# Checkpoints: servable drafter + training state, written to a temp dir then renamed

def checkpoint_steps(out_dir):
    root = os.path.join(out_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    return sorted(int(d[5:]) for d in os.listdir(root) if d.startswith("step_") and d[5:].isdigit())


def save_checkpoint(out_dir, step, worker, consumed_batches, args):
    """A kill at any point leaves the previous checkpoints intact: write to a temporary
    directory, then rename; prune old ones only after the new one exists."""
    root = os.path.join(out_dir, "checkpoints")
    final, tmp = os.path.join(root, f"step_{step}"), os.path.join(root, f".tmp_step_{step}")
    shutil.rmtree(tmp, ignore_errors=True)
    worker.drafter.save_pretrained(tmp)  # fp32 master weights, servable as is
    state = {"step": step, "consumed_batches": consumed_batches, "optimizer": worker.optimizer.state_dict(),
             "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, list, bool, type(None)))}}
    torch.save(state, os.path.join(tmp, "training_state.pt"))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in checkpoint_steps(out_dir)[:-args.keep_checkpoints]:
        shutil.rmtree(os.path.join(root, f"step_{old}"), ignore_errors=True)
    return final


def find_resume_dir(spec, out_dir):
    if spec != "auto":
        if not os.path.exists(os.path.join(spec, "training_state.pt")):
            raise UsageError(f"--resume {spec}: not a checkpoint directory (no training_state.pt)")
        return spec
    steps = checkpoint_steps(out_dir)
    return os.path.join(out_dir, "checkpoints", f"step_{steps[-1]}") if steps else None


# -----------------------------------------------------------------------------
# Logging: time spent in the target stage, and the run's shared state

class StageClock:
    """Busy time of a stage whose work is asynchronous on a GPU: CUDA event pairs, read once
    they have completed (no host sync); wall time on CPU."""

    def __init__(self):
        self.pending, self.seconds, self.t0 = [], 0.0, None

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
            self.pending.append((self.t0, end))
        else:
            self.seconds += time.perf_counter() - self.t0

    def total(self):
        done = [p for p in self.pending if p[1].query()]
        self.pending = [p for p in self.pending if not p[1].query()]
        self.seconds += sum(a.elapsed_time(b) for a, b in done) / 1000
        return self.seconds


class Run:
    """What the main thread and the workers share: stop flag, errors, logging, checkpoint duty."""

    def __init__(self, args, total_steps, warmup_steps, start_step, stream, devices, log_file, cluster=None):
        self.args, self.total_steps, self.warmup_steps, self.start_step = args, total_steps, warmup_steps, start_step
        self.stream = stream
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
        self.last_log = (time.perf_counter(), start_step)
        self.target_clock, self.target_batches, self.target_batches_logged = StageClock(), 0, 0
        self.target_seconds_logged = 0.0
        self.eval_prompts, self.tokenizer, self.eval_target = [], None, None  # for --eval-interval

    def lr_at(self, step):
        return lr_at(step, self.total_steps, self.warmup_steps, self.args.lr)

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
        eval_step = bool(a.eval_interval) and step % a.eval_interval == 0
        # Every machine logs on the same steps (the figures are summed across machines); only the
        # first evaluates and saves.
        due_log = step % a.log_interval == 0 or last or eval_step
        due_eval = eval_step and bool(self.eval_prompts) and main
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
        if due_eval:
            self.evaluate_now(step, rec["tau_hat"])
        if due_save:
            self.save(step)

    def save(self, step):
        self.log(f"checkpoint: {save_checkpoint(self.args.output_dir, step, self.workers[0], step * self.num_workers, self.args)}")

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

    def write_metrics(self, step):
        now = time.perf_counter()
        t_prev, s_prev = self.last_log
        dt, steps, W = max(now - t_prev, 1e-9), step - s_prev, self.num_workers
        stats = self.cluster.all_reduce_(sum(w.stats.cpu() for w in self.workers))
        m = dm.stats_to_metrics(stats[:-1], steps * W)
        target_s = self.target_clock.total()
        target_batches = self.target_batches - self.target_batches_logged
        target_dt = target_s - self.target_seconds_logged
        self.target_batches_logged, self.target_seconds_logged = self.target_batches, target_s
        budget = self.args.token_budget
        rec = {
            "step": step, "epoch": round(step * W / self.stream.batches_per_epoch, 3),
            "tokens_per_s": steps * W * budget / dt,
            "real_tokens_per_s": steps * W * budget * self.stream.packing_efficiency / dt,
            "target_tokens_per_s": target_batches * budget / target_dt if target_dt > 0 else None,
            "drafter_steps_per_s": steps / dt,
            "queue_depths": [w.queue.qsize() for w in self.workers],
            "loss": m["loss"], "acc": m["acc_mean"], "acc_per_slot": m["acc"], "tau_hat": m["tau_hat"],
            "lr": self.lr_at(step), "grad_norm": float(stats[-1]) / max(steps * W, 1),
            "peak_mem_gb": {str(d): round(torch.cuda.max_memory_allocated(d) / 2**30, 2) for d in self.cuda_devices},
        }
        for w in self.workers:
            w.stats = None
        self.last_log = (now, step)
        if self.metrics_file is not None:
            self.metrics_file.write(json.dumps(rec) + "\n")
            self.metrics_file.flush()
        tt = f"{rec['target_tokens_per_s']:,.0f}" if rec["target_tokens_per_s"] else "-"
        self.log(f"step {step}/{self.total_steps} ep {rec['epoch']:.2f} | tok/s {rec['tokens_per_s']:,.0f} "
                 f"(real {rec['real_tokens_per_s']:,.0f}, target stage {tt}) | drafter "
                 f"{rec['drafter_steps_per_s']:.2f} step/s | queues {rec['queue_depths']} | loss {m['loss']:.4f} "
                 f"acc {m['acc_mean']:.3f} tau {m['tau_hat']:.2f} | lr {rec['lr']:.2e} gnorm {rec['grad_norm']:.3f}"
                 + (f" | peak GB {rec['peak_mem_gb']}" if rec["peak_mem_gb"] else ""))
        return rec

    def evaluate_now(self, step, tau_hat):
        """The real acceptance length of the current drafter (lossless speculative decoding on
        held-out prompts) next to the training estimate tau_hat of the last log interval."""
        from scripts.eval_acceptance import evaluate_models, load_target
        w = self.workers[0]
        if self.eval_target is None:
            self.eval_target = load_target(resolve_model_path(self.args.target_model), w.device)
        w.drafter.eval()
        try:
            report = evaluate_models(self.eval_target, self.tokenizer, w.drafter, self.eval_prompts, w.device,
                                     self.args.eval_max_new_tokens, log=lambda m: None)
        finally:
            w.drafter.train()
        measured = report["acceptance_length"]
        tf = report["teacher_forced_tau_hat"]
        self.log(f"eval step {step}: acceptance length {measured:.3f} measured on {len(self.eval_prompts)} held-out "
                 f"prompts vs tau_hat {tau_hat:.3f} estimated in training ({(tau_hat - measured) / measured:+.1%}); "
                 f"tau_hat on the target's own outputs for those prompts {tf:.3f} ({(tf - measured) / measured:+.1%}); "
                 f"lossless {report['lossless']}")
        self.metrics_file.write(json.dumps({"step": step, "eval_acceptance_length": measured, "tau_hat": tau_hat,
                                            "teacher_forced_tau_hat": tf, "eval_lossless": report["lossless"]}) + "\n")
        self.metrics_file.flush()


# -----------------------------------------------------------------------------
# The main thread: target forward per batch, features to a worker's device, into its queue

def put(run, worker, item):
    while not run.stop.is_set() and worker.thread.is_alive():
        try:
            worker.queue.put(item, timeout=0.2)
            return
        except queue.Full:
            pass


def feed(run, replicas, stream, start_step):
    """Batches go round-robin over target replicas and workers, a whole round (one batch per
    worker) per step, so every worker runs the same number of steps. Over several machines a
    step's round spans the workers of all of them, and this machine feeds its own slice of it.
    Ends with a sentinel."""
    first = run.cluster.rank * len(run.workers)
    batches = stream.iterate(start_step * run.num_workers, run.num_workers, range(first, first + len(run.workers)))
    step = start_step
    while step < run.total_steps and not run.stop.is_set() and not run.interrupted:
        for w in run.workers:
            _, batch = next(batches)
            replica = replicas[run.target_batches % len(replicas)]
            run.target_clock.start(replica.device)
            feats = replica.features(batch)
            run.target_clock.stop(replica.device)
            item = {k: v.to(w.device, non_blocking=True) for k, v in batch.items()}
            # A graphed replica returns its static output, overwritten by the next replay: copy it.
            item["features"] = feats.to(w.device, non_blocking=True, copy=replica.graph is not None)
            if w.device.type == "cuda":
                item["ready"] = torch.cuda.Event()
                item["ready"].record(torch.cuda.current_stream(w.device))
            run.target_batches += 1
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
# Main

def run_pipeline(run, replicas, drafters, drafter_devices, optimizer_state=None, show_progress=True):
    """Warm up (and with --compile capture) every stage, then stream batches until the run ends,
    the run is interrupted, or any thread fails. Errors are left in run.errors."""
    args = run.args
    if any(d.type == "cuda" for d in drafter_devices + [r.device for r in replicas]):
        # Workers need the interpreter between the main thread's Python ops (brief section 4).
        sys.setswitchinterval(args.switch_interval)
    run.averager = GradAverager(len(drafters), run.cluster, stop_requested=lambda: run.stop_asked)
    run.workers = [DrafterWorker(i, dev, d, args, run.averager, run)
                   for i, (dev, d) in enumerate(zip(drafter_devices, drafters))]
    if optimizer_state is not None:
        for w in run.workers:
            w.load_optimizer_state(optimizer_state)
    run.features_dim = len(args.layer_ids) * drafters[0].config.hidden_size
    warm_up_target(replicas, args, run.log)

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
        feed(run, replicas, run.stream, run.start_step)
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
        d.embed_weight, d.lm_head_weight = embed.to(dev, dtype), head.to(dev, dtype)
        drafters.append(d)
    log(f"drafter: {master.num_parameters() / 1e6:.1f}M parameters, {cfg.num_hidden_layers} layers, block "
        f"{cfg.block_size}, target layers {master.target_layer_ids}, mask token {args.mask_token_id}")
    return drafters


def default_mask_token_id(tokenizer, vocab_size, corpus):
    """The first embedding row the tokenizer never produces; if it uses them all, a special token
    that is not bos/eos/pad and never appears in the corpus."""
    if len(tokenizer) < vocab_size:
        return len(tokenizer)
    reserved = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    seen = set(np.unique(corpus.ids).tolist())
    for tid in sorted(set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))):
        if tid not in reserved and tid not in seen and tid < vocab_size:
            return int(tid)
    raise UsageError(f"the tokenizer uses all {vocab_size} embedding rows and every special token; pass "
                     "--mask-token-id (an id that never appears in training text)")


def resolve_data_paths(patterns):
    if patterns == [DEFAULT_DATA]:
        return [builtin_data_file()]
    return expand_data_paths(patterns)


# The built-in demo (no arguments): a real 135M chat model and real conversations, sized to
# finish on a laptop CPU in minutes. Explicit flags still win.
DEMO_DEFAULTS = dict(max_length=256, token_budget=1024, num_anchors=16, num_draft_layers=2, lr=1e-3,
                     max_steps=60, log_interval=5, save_interval=30, output_dir="runs/demo", eval_prompts=6,
                     eval_max_new_tokens=48)


def apply_demo_defaults(parser, args):
    """With the built-in model, demo sizes replace the defaults the user did not override."""
    if args.target_model == DEFAULT_MODEL:
        for key, value in DEMO_DEFAULTS.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
    return args


def main(argv=None):
    parser = build_parser()
    args = apply_demo_defaults(parser, parser.parse_args(argv))
    try:
        return train(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def resolve_settings(args):
    """Check every setting and resolve the layout and target layers, before any model loads.
    Returns (target devices, drafter devices, target text config)."""
    check_args(args)
    target_devices, drafter_devices = resolve_layout(args)
    if args.compile and any(d.type != "cuda" for d in drafter_devices):
        raise UsageError("--compile captures CUDA graphs and needs GPU drafter devices; drop it on CPU")
    from transformers import AutoConfig
    target_config = AutoConfig.from_pretrained(resolve_model_path(args.target_model))
    check_target_config(target_config, args.target_model)
    tc = dm.text_config(target_config)
    args.layer_ids = ([int(x) for x in args.target_layer_ids.split(",")] if args.target_layer_ids
                      else dm.default_target_layer_ids(tc.num_hidden_layers, args.num_draft_layers))
    if not all(0 <= i < tc.num_hidden_layers for i in args.layer_ids):
        raise UsageError(f"--target-layer-ids {args.layer_ids}: each must lie in [0, {tc.num_hidden_layers})")
    args.attention = "flex" if drafter_devices[0].type == "cuda" else "sdpa"
    return target_devices, drafter_devices, tc


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


def prepare_data(args, tc, log):
    """Tokeniser, tokenised corpus (cached) and the fixed-shape batch stream."""
    tokenizer = load_tokenizer(args.target_model)
    corpus = load_corpus(resolve_data_paths(args.data), tokenizer, args.max_length, tc.vocab_size,
                         args.cache_dir, log)
    if args.mask_token_id is None:
        args.mask_token_id = default_mask_token_id(tokenizer, tc.vocab_size, corpus)
    return tokenizer, corpus, BatchStream(corpus, args.token_budget // args.max_length, args.max_length, args.seed)


def train(args):
    target_devices, drafter_devices, tc = resolve_settings(args)
    cluster = Cluster.from_env(drafter_devices, args.dist_timeout)
    rc = train_on(args, cluster, target_devices, drafter_devices, tc)
    if rc == 0:  # after a failure a collective may still wait in a worker thread: exiting tears it down
        cluster.close()
    return rc


def train_on(args, cluster, target_devices, drafter_devices, tc):
    log_file, log = open_log(args, cluster)
    tokenizer, corpus, stream = prepare_data(args, tc, log)
    rows_per_batch = args.token_budget // args.max_length
    W = len(drafter_devices) * cluster.world_size
    total_steps = args.max_steps or max(1, int(args.epochs * stream.batches_per_epoch) // W)
    warmup_steps = math.ceil(args.warmup_ratio * total_steps)
    if cluster.world_size > 1:
        log(f"machines: this is {cluster.rank} of {cluster.world_size} (pid {os.getpid()}); {W} drafter workers in all")
    log(f"layout: target {[str(d) for d in target_devices]} | drafter workers {[str(d) for d in drafter_devices]}")
    log(f"batches: {rows_per_batch} x {args.max_length} = {args.token_budget} tokens, "
        f"{args.num_anchors * rows_per_batch} anchors x block {args.block_size}; packing efficiency "
        f"{stream.packing_efficiency:.1%}; {stream.batches_per_epoch} batches/epoch; {total_steps} steps "
        f"({warmup_steps} warmup)")

    # Models
    replicas, embed, head = load_target(args.target_model, target_devices, args.layer_ids, log)
    drafters = build_drafters(args, tc, drafter_devices, embed, head, log)

    # Resume
    start_step, state = 0, None
    resume_dir = find_resume_dir(args.resume, args.output_dir) if args.resume else None
    if args.resume and resume_dir is None:
        log("resume: no checkpoint in --output-dir yet; starting fresh")
    if resume_dir:
        from safetensors.torch import load_file
        weights = load_file(os.path.join(resume_dir, "model.safetensors"))
        state = torch.load(os.path.join(resume_dir, "training_state.pt"), map_location="cpu", weights_only=False)
        for d in drafters:
            d.load_state_dict(weights)
        start_step = state["step"]
        log(f"resume: {resume_dir} at step {start_step}")
    cluster.check_same("[step to resume from, total steps, batches per epoch]",
                       [start_step, total_steps, stream.batches_per_epoch])

    if start_step >= total_steps:
        log(f"nothing to do: already at step {start_step} of {total_steps}")
        return 0
    run = Run(args, total_steps, warmup_steps, start_step, stream, target_devices + drafter_devices, log_file,
              cluster)
    if args.eval_interval and cluster.is_main:
        from scripts.eval_acceptance import heldout_prompts
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
    if not cluster.is_main:
        run.log(f"done: {final_step} steps; the first machine saves the drafter")
        return 0
    if final_step not in checkpoint_steps(args.output_dir):  # interrupted between saves
        run.save(final_step)
    final_dir = os.path.join(args.output_dir, "final")
    shutil.rmtree(final_dir, ignore_errors=True)
    run.workers[0].drafter.save_pretrained(final_dir, dtype=torch.bfloat16)
    skipped = corpus.stats["skipped"]
    run.log(f"data: {corpus.stats['documents']} documents, {corpus.stats['truncated']} truncated, "
            f"{sum(skipped.values())} rows skipped {skipped or ''}")
    run.log(f"done: {final_step} steps; drafter saved to {final_dir}")
    if not run.interrupted and args.eval_prompts > 0:
        evaluate_final(args, run, tokenizer, final_dir)
    return 0


def evaluate_final(args, run, tokenizer, final_dir):
    """Measured acceptance length of the final drafter on held-out prompts: real speculative
    decoding against the target, checked lossless."""
    from scripts.eval_acceptance import evaluate, heldout_prompts
    prompts = heldout_prompts(args, tokenizer, args.eval_prompts)
    if not prompts:
        run.log("eval: no held-out prompts available")
        return
    report = evaluate(resolve_model_path(args.target_model), final_dir, prompts, device=run.workers[0].device,
                      max_new_tokens=args.eval_max_new_tokens, log=run.log, target=run.eval_target)
    run.log(f"eval: acceptance length {report['acceptance_length']:.2f} on {len(prompts)} held-out prompts, "
            f"outputs identical to target greedy: {report['lossless']}; report {final_dir}/eval_acceptance.json")


if __name__ == "__main__":
    sys.exit(main())
