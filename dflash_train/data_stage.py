"""The data stage: the tokenised corpus into fixed-shape packed batches, the held-out validation
rows, and the mask token (an id the text, the template and the data never use)."""

import collections
import dataclasses
import hashlib
import math
import re

import numpy as np
import torch

from dflash_train.chat_data import Corpus, UsageError, load_corpus, render_chat, resolve_data_paths, special_token_ids
from dflash_train.demo_assets import BUILTIN_REGENERATED
from dflash_train.regeneration import regenerated_builtin_data
from dflash_train.target_model import generation_config_of, resolve_model_path, stop_token_ids


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
    docs_of = collections.Counter(key)
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
    boundary = r"end|eos|eot|pad|stop|bos|begin|start|unk|sep|mask"
    neutral = [i for i in unused if not re.search(boundary, name(i).lower())]
    if reserved or neutral:
        return int((reserved or neutral)[0])
    raise UsageError(f"the tokenizer uses all {vocab_size} embedding rows and has no unused special token; pass "
                     "--mask-token-id (an id that never appears in text, the template or generation)")


@dataclasses.dataclass(frozen=True)
class TrainingData:
    """What the data stage hands on: the values it derives from the data travel here, beside
    the Settings they do not change."""
    files: list  # the data's files (built-in names and globs resolved)
    corpus: Corpus  # every document, tokenised
    batches: BatchSequence  # the training documents' fixed-shape batches
    validation: list  # validation_batches of the held-out documents ([] without)
    mask_token_id: int  # fills block slots 1..: --mask-token-id, or an id the data never uses


def prepare_data(settings, tokenizer, vocab_size, log):
    """The data stage end to end: the data's files (the built-in regenerated data written first
    where it is asked for and missing), the tokenised corpus (cached), the fixed-shape batch
    sequence of its training documents, rows of its held-out validation documents
    (--val-fraction), and the mask token."""
    s = settings
    files = resolve_data_paths([regenerated_builtin_data(s, log) if p == BUILTIN_REGENERATED else p for p in s.data])
    corpus = load_corpus(files, tokenizer, s.max_length, vocab_size, s.cache_dir, s.chat_template_kwargs, log,
                         workers=s.data_workers, fields=s.data_fields)
    train_docs, val_docs = split_validation(corpus, s.val_fraction, s.seed)
    validation = validation_batches(corpus.subset(val_docs), s.max_length, s.seed, s.val_rows,
                                    s.rows_per_batch) if len(val_docs) else []
    if validation:
        log(f"data: {len(val_docs)} documents held out for validation ({validation_row_count(validation)} rows), "
            "never trained on")
    batches = BatchSequence(corpus, s.rows_per_batch, s.max_length, s.seed, train_docs)
    mask_token_id = choose_mask_token_id(tokenizer, vocab_size, corpus, s.mask_token_id, s.target_model,
                                         s.chat_template_kwargs)
    return TrainingData(files, corpus, batches, validation, mask_token_id)
