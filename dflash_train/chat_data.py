"""Chat data -> training documents: rows of JSONL files -> messages -> what the server shows and
what the model writes, as token ids with a loss mask -> the tokenised corpus (cached).

A document is what the drafter trains on: for every assistant turn, exactly what a server
shows the target when it asks for that turn (the conversation so far, rendered by the chat
template with the generation prompt), followed by exactly what the target writes (the turn's
text through its end-of-turn token), with loss on the latter only. Templates that keep
earlier turns unchanged give one document per conversation; templates that rewrite history
(Qwen3 strips earlier <think> blocks) start a new document at the turn where the rendered
history stops being a prefix of the next render. Reasoning (`reasoning_content`), tool calls
(`tool_calls`), tool turns and a row's `tools` schema go to the template as a server passes them:
what the model writes (reasoning, text, tool-call text) carries loss, tool results do not; a turn
whose reasoning or tool calls the template would not render is a counted skip.

Used by the trainer's data stage, regeneration, evaluation (prompt rendering) and
scripts/inspect_data.py.
"""

import glob
import hashlib
import json
import multiprocessing
import os
import time

import numpy as np

from dflash_train.demo_assets import builtin_data
from dflash_train.helpers import signals_handled

class UsageError(Exception):
    """A setting that cannot work: reported with what to change, before any model loads."""


TOKENIZATION_VERSION = 3  # part of the corpus cache key: a change here never reuses a stale cache


ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system",
                "tool": "tool", "observation": "tool"}


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
        raise UsageError(f"--chat-template-kwargs {text!r} must be a JSON object, "
                         "e.g. '{\"enable_thinking\": false}'")
    return value


def written(message):
    """Whether an assistant turn holds anything the model wrote: text, reasoning or tool calls."""
    return bool(message["content"].strip() or message.get("reasoning_content", "").strip()
                or message.get("tool_calls"))


def served_tool_calls(calls):
    """An assistant turn's tool calls as vLLM hands them to the chat template: each call's
    arguments a mapping (a JSON string, as OpenAI-style data and servers hold them, parsed; an
    empty or missing one {}), so a template's `arguments | tojson` prints the object the model
    writes, never a string of it. BadRow naming a call that is not one."""
    out = []
    for i, call in enumerate(calls):
        function = call.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise BadRow(f"tool_calls[{i}] of an assistant turn has no function name")
        arguments = function.get("arguments")
        if not arguments:
            arguments = {}
        elif isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise BadRow(f"tool_calls[{i}].function.arguments is neither JSON nor a mapping") from None
        elif not isinstance(arguments, (dict, list)):
            raise BadRow(f"tool_calls[{i}].function.arguments is neither JSON nor a mapping")
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def row_to_messages(row, require_assistant=True):
    """[{role, content, ...}] of a `messages` (OpenAI) or `conversations` (ShareGPT) row, roles
    normalised; an assistant turn keeps its reasoning (`reasoning_content`, or a server's
    `reasoning`) and `tool_calls`, a tool turn its `tool_call_id` and `name`, as a server passes
    them to the chat template. BadRow naming what is wrong with a row that is not one."""
    field, role_key, text_key = (("messages", "role", "content") if "messages" in row
                                 else ("conversations", "from", "value") if "conversations" in row else (None,) * 3)
    if field is None:
        raise BadRow("no 'messages', 'conversations' or 'input_ids'")
    if not isinstance(row[field], list):
        raise BadRow(f"{field} is not a list")
    if not all(isinstance(m, dict) for m in row[field]):
        raise BadRow(f"a turn of {field} is not a JSON object")
    messages = []
    for turn in row[field]:
        role, content = turn.get(role_key), turn.get(text_key)
        if role not in ROLE_ALIASES:
            raise BadRow(f"unknown role {role!r}")
        message = {"role": ROLE_ALIASES[role]}
        if message["role"] == "assistant":
            reasoning = turn.get("reasoning_content", turn.get("reasoning"))
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise BadRow("reasoning_content of an assistant turn is not text")
                message["reasoning_content"] = reasoning
            calls = turn.get("tool_calls")
            if calls:
                if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
                    raise BadRow("tool_calls of an assistant turn is not a list of objects")
                message["tool_calls"] = calls = served_tool_calls(calls)
            if content is None and (reasoning is not None or calls):
                content = ""  # a turn that only reasons or calls tools (the servers send null content)
        elif message["role"] == "tool":
            message.update({k: turn[k] for k in ("tool_call_id", "name") if turn.get(k) is not None})
        if not isinstance(content, str):
            raise BadRow(f"content of a {role} turn is not text")
        message["content"] = content
        messages.append(message)
    if not messages:
        raise BadRow("empty conversation")
    if require_assistant and not any(m["role"] == "assistant" and written(m) for m in messages):
        raise BadRow("no assistant turn")
    return messages


def row_tools(row):
    """The row's `tools` schema (a list of objects, as a server passes it to the chat template), or None."""
    tools = row.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadRow("tools is not a list of objects")
    return tools


def render_chat(tokenizer, messages, add_generation_prompt=False, chat_template_kwargs=None, tools=None):
    """The text the chat template renders, as a server renders it (the row's tools schema too)."""
    extra = {"tools": tools} if tools is not None else {}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **extra, **(chat_template_kwargs or {}))


def dropped_fields(tokenizer, messages, i, whole, chat_template_kwargs, tools):
    """The fields of assistant turn i (reasoning_content, tool_calls) that the chat template does
    not render: the rendering without them is the same text. Such a turn cannot be trained as the
    model wrote it."""
    out = []
    for field in ("reasoning_content", "tool_calls"):
        if messages[i].get(field):
            without = {k: v for k, v in messages[i].items() if k != field}
            if render_chat(tokenizer, messages[:i] + [without], False, chat_template_kwargs, tools) == whole:
                out.append(field)
    return out


def prompt_ids(tokenizer, messages, chat_template_kwargs=None, tools=None):
    """The prompt a server builds for the next assistant turn: rendered, then tokenised, as the
    data stage does it."""
    text = render_chat(tokenizer, messages, True, chat_template_kwargs, tools)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


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


def conversation_documents(tokenizer, messages, max_length, chat_template_kwargs, stats, where, special=None,
                           tools=None):
    """Documents of one conversation, per the rules at the top of this module; tools: the row's
    schema, rendered as a server renders it. special: the tokenizer's special_token_ids
    (computed here if not given)."""
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
        if not written(messages[i]):
            stats.note(stats.skipped_turns, "empty assistant turn", where)
            continue
        try:
            prompt = render_chat(tokenizer, messages[:i], True, chat_template_kwargs, tools)
            whole = render_chat(tokenizer, messages[:i + 1], False, chat_template_kwargs, tools)
            dropped = dropped_fields(tokenizer, messages, i, whole, chat_template_kwargs, tools)
        except Exception as e:  # jinja raises for conversations a template refuses (roles must alternate...)
            stats.note(stats.skipped_turns, f"chat template error: {str(e)[:80]}", where)
            continue
        if dropped:
            stats.note(stats.skipped_turns, f"the chat template does not render {' or '.join(dropped)}", where)
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
        if not isinstance(t, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in t):
            raise BadRow("input_ids is not a list of token ids")
        if not isinstance(m, list) or len(m) != len(t) or not t or not all(x in (0, 1) for x in m):
            raise BadRow("input_ids needs a loss_mask of 0s and 1s of the same length")
        if min(t) < 0 or max(t) >= vocab_size:
            raise BadRow("input_ids outside the target vocabulary")
        stats.counts["assistant_turns"] += 1
        stats.counts["trained_turns"] += 1
        stats.counts["assistant_tokens"] += int(sum(1 for x in m if x))
        return windows_to_documents(t, [int(bool(x)) for x in m], max_length, stats, where)
    return conversation_documents(tokenizer, row_to_messages(row), max_length, chat_template_kwargs, stats, where,
                                  special, row_tools(row))


def parsed_rows(lines, path, stats, fields=None):
    """(row number, 'file:row', parsed row) of rows [(number, JSONL text or a row already
    parsed)] of a data file (numbered_rows), its fields renamed by `fields` {the name this tool
    reads: the data's name}; rows counted in stats, lines that are not JSON or not UTF-8 counted as
    skipped."""
    for lineno, line in lines:
        stats.counts["rows"] += 1
        where = f"{os.path.basename(os.path.normpath(path))}:{lineno}"
        if line is None:
            stats.note(stats.skipped_rows, "not UTF-8 text", where)
            continue
        try:
            row = json.loads(line) if isinstance(line, str) else line
        except json.JSONDecodeError as e:
            stats.note(stats.skipped_rows, f"bad JSON: {e.msg}", where)
            continue
        if fields and isinstance(row, dict):
            row = {**{k: v for k, v in row.items() if k not in fields.values()},
                   **{ours: row[theirs] for ours, theirs in fields.items() if theirs in row}}
        yield lineno, where, row


# Compressed files, by their first bytes: read through the standard library's readers, or named.
COMPRESSED = {b"\x1f\x8b": ("gzip", "gzip"), b"BZh": ("bzip2", "bz2"), b"\xfd7zXZ\x00": ("xz", "lzma"),
              b"\x28\xb5\x2f\xfd": ("zstd", None)}
BOM = b"\xef\xbb\xbf"  # a UTF-8 byte-order mark some editors put in front of a file


def open_data(path):
    """A data file opened for reading bytes: a gzip, bzip2 or xz file decompressed as it is read;
    a compressed format the standard library does not read is named (UsageError)."""
    with open(path, "rb") as f:
        magic = f.read(6)
    for prefix, (name, module) in COMPRESSED.items():
        if magic.startswith(prefix):
            if module is None:
                raise UsageError(f"--data {path}: a {name}-compressed file; decompress it first ({name} -d {path})")
            return __import__(module).open(path, "rb")
    return open(path, "rb")


def numbered_lines(path, skip=frozenset()):
    """(line number, text) of every non-empty line of a file (decompressed, a leading byte-order
    mark dropped) whose line number is not in skip; the text is None for a line that is not UTF-8
    (never trained as replacement characters)."""
    with open_data(path) as f:
        for lineno, raw in enumerate(f, 1):
            if lineno == 1 and raw.startswith(BOM):
                raw = raw[len(BOM):]
            if not raw.strip() or lineno in skip:
                continue
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError:
                yield lineno, None


def present(value):
    """A columnar row without the fields it has no value in, at every depth: Arrow gives every row
    every column, and every struct (a message, a tool call's arguments) every field any row's
    has, null where it has none; a row written as JSON would not hold them, and a template would
    render them (a tool call's arguments with the other rows' keys as null)."""
    if isinstance(value, dict):
        return {k: present(v) for k, v in value.items() if v is not None}
    if isinstance(value, list) and value and isinstance(value[0], (dict, list)):  # not a row's token ids
        return [present(v) for v in value]
    return value


def numbered_rows(path):
    """(row number, row) of every row of a data file: JSONL lines as text (numbered by line; parsed
    by parsed_rows, so bad JSON is a counted skip), the objects of a JSON array file, the rows of a
    Parquet file (pyarrow) or of a directory saved by datasets' save_to_disk (numbered from 1)."""
    def needs(module, what):
        try:
            return __import__(module)
        except ImportError:
            raise UsageError(f"--data {path}: reading {what} needs the {module} package (pip install {module})") \
                from None
    if os.path.isdir(path):
        needs("datasets", "a directory saved by datasets")
        from datasets import DatasetDict, load_from_disk
        data = load_from_disk(path)
        if isinstance(data, DatasetDict):
            if "train" not in data and len(data) != 1:
                raise UsageError(f"--data {path}: splits {list(data)}, none named train: give the split's directory")
            data = data["train"] if "train" in data else next(iter(data.values()))
        return [(n, present(row)) for n, row in enumerate(data, 1)]
    if path.endswith(".parquet"):
        needs("pyarrow", "Parquet")
        import pyarrow.parquet as pq
        return [(n, present(row)) for n, row in enumerate(pq.read_table(path).to_pylist(), 1)]
    with open_data(path) as f:
        head = f.read(4096).removeprefix(BOM).lstrip()
    name = path.removesuffix(".gz").removesuffix(".bz2").removesuffix(".xz")
    if name.endswith(".json") and head.startswith(b"["):  # a .json file of rows: one JSON array
        try:
            with open_data(path) as f:
                return list(enumerate(json.loads(f.read().decode("utf-8-sig")), 1))
        except (ValueError, UnicodeDecodeError) as e:
            raise UsageError(f"--data {path}: opens with [ but is not a JSON array ({str(e)[:120]})") from None
    first = head.split(b"\n", 1)[0].strip()
    if head.startswith(b"{") and not first.endswith(b"}"):  # an object over several lines: one JSON object?
        try:
            with open_data(path) as f:
                whole = json.loads(f.read().decode("utf-8-sig"))
        except (ValueError, UnicodeDecodeError):
            whole = None  # JSONL with a bad first line: counted as such
        if isinstance(whole, dict):
            rows = [(k, len(v)) for k, v in whole.items() if isinstance(v, list) and v and isinstance(v[0], dict)]
            raise UsageError(f"--data {path}: one JSON object, not rows: give JSONL (one row a line) or a JSON array "
                             "of rows" + (f" (its '{rows[0][0]}' field holds {rows[0][1]} rows)" if rows else ""))
    return list(numbered_lines(path))


DATA_FIELDS = ("messages", "conversations", "input_ids", "loss_mask")  # the fields a row is read by


def parse_data_fields(text):
    """--data-fields 'messages=conversation,input_ids=tokens' -> {the name read here: the data's}."""
    fields = {}
    for item in filter(None, (text or "").split(",")):
        ours, sep, theirs = item.partition("=")
        if not sep or ours.strip() not in DATA_FIELDS or not theirs.strip():
            raise UsageError(f"--data-fields {text!r}: each item is NAME=FIELD with NAME one of "
                             f"{', '.join(DATA_FIELDS)}")
        fields[ours.strip()] = theirs.strip()
    return fields


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
            self.log(f"{self.desc}: {self.done}/{self.total} {self.unit}s, {self.tokens:,} tokens, "
                     f"{rate:,.0f} tokens/s")

    def close(self):
        self.bar.close()


def rows_documents(lines, path, tokenizer, max_length, vocab_size, chat_template_kwargs, special, fields=None):
    """(documents, DocumentStats) of some rows [(number, row)] of one data file (numbered_rows)."""
    docs, stats = [], DocumentStats()
    for _, where, row in parsed_rows(lines, path, stats, fields):
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
                   log=print, fields=None):
    """Every document of one data file (any format numbered_rows reads; `fields` renames its
    fields, parsed_rows), and its DocumentStats. Unusable rows are skipped and
    counted by reason; so are turns that cannot be trained. With workers > 1 (0: one per CPU core,
    at most 32), chunks of rows are rendered and tokenised by that many forked processes (a chat
    template renders in Python, on one core) and put back in file order: the same documents and
    counts as one process; a process that dies raises BrokenProcessPool. Progress: a bar of rows
    on a terminal, else a log line a minute."""
    special = special_token_ids(tokenizer)  # once per file, not per row (Gemma 3 has thousands)
    reading = (path, tokenizer, max_length, vocab_size, chat_template_kwargs, special, fields)
    lines = numbered_rows(path)
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

    def on_signal(signum):  # SIGINT or SIGTERM: stop here, the workers with it
        raise KeyboardInterrupt
    try:
        with signals_handled(on_signal):
            for chunk_docs, chunk_stats in results:
                docs += chunk_docs
                stats.add(chunk_stats)
                progress(chunk_stats.counts["rows"], sum(len(t) for t, _ in chunk_docs))
    finally:
        progress.close()
        if pool is not None:
            workers_left = list(getattr(pool, "_processes", {}).values())  # the executor keeps them there
            pool.shutdown(wait=False, cancel_futures=True)
            for process in workers_left:  # none outlives the read, whatever stopped it
                process.kill()
                process.join()
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
            if not os.path.exists(h):
                raise UsageError(f"--data {h}: no such file")
        paths += hits
    return paths


def resolve_data_paths(patterns):
    return expand_data_paths([builtin_data(p) for p in patterns])


def tokenizer_fingerprint(tokenizer):
    """The tokenizer's contents (vocabulary, merges, special tokens, chat template), hashed."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    h = hashlib.sha256(body.encode())
    h.update(str(tokenizer.chat_template).encode())
    h.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def corpus_cache_key(paths, tokenizer, max_length, vocab_size, chat_template_kwargs, fields=None):
    """The tokenised corpus's cache key: every data file's contents (not its name, size or time:
    a file edited in place is new data), the tokenizer, the template options, the fields read and
    the shapes."""
    h = hashlib.sha256()
    for p in paths:  # a directory (a saved data set): every file in it
        files = sorted(os.path.join(d, f) for d, _, fs in os.walk(p) for f in fs) if os.path.isdir(p) else [p]
        for f in files:
            with open(f, "rb") as data:
                h.update(hashlib.file_digest(data, "blake2b").digest())
    h.update(f"{tokenizer_fingerprint(tokenizer)}|{json.dumps(chat_template_kwargs or {}, sort_keys=True)}|"
             f"{json.dumps(fields or {}, sort_keys=True)}|{max_length}|{vocab_size}|v{TOKENIZATION_VERSION}".encode())
    return h.hexdigest()[:20]


def load_corpus(paths, tokenizer, max_length, vocab_size, cache_dir, chat_template_kwargs=None, log=print,
                max_bad_fraction=0.5, workers=1, fields=None):
    """Every file's documents (read_documents), concatenated and cached; the stats are logged as a
    summary (counts by reason, a few examples), never row by row."""
    key = corpus_cache_key(paths, tokenizer, max_length, vocab_size, chat_template_kwargs, fields)
    cache_file = os.path.join(cache_dir, f"corpus_{key}.npz")
    if os.path.exists(cache_file):
        try:
            z = np.load(cache_file, allow_pickle=False)
            corpus = Corpus(z["ids"], z["mask"], z["offsets"], DocumentStats.from_dict(json.loads(str(z["stats"]))))
            if not len(corpus.ids) == len(corpus.mask) == corpus.offsets[-1]:
                raise ValueError("its arrays disagree")
            log(f"data: {len(corpus)} documents from cache {cache_file}")
            return corpus
        except Exception as e:  # noqa: BLE001  (a torn or foreign file: whatever numpy or zipfile raise)
            log(f"data: the cache {cache_file} cannot be read ({type(e).__name__}: {str(e)[:120]}); tokenising anew")
    from tqdm import tqdm
    docs, stats = [], DocumentStats()
    for path in tqdm(paths, unit="file", disable=None if len(paths) > 1 else True, desc="tokenising"):
        file_docs, file_stats = read_documents(path, tokenizer, max_length, vocab_size, chat_template_kwargs,
                                               workers, log=log, fields=fields)
        docs += file_docs
        stats.add(file_stats)
    n_bad, rows = sum(stats.skipped_rows.values()), stats.counts["rows"]
    if not docs:
        turns = sorted(stats.skipped_turns.items(), key=lambda kv: -kv[1])[:3]
        raise UsageError(f"--data: no usable documents in {paths} ({n_bad} rows skipped: {stats.skipped_rows})"
                         + ("; assistant turns skipped: " + "; ".join(f"{reason} ({n})" for reason, n in turns)
                            if turns else ""))
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
