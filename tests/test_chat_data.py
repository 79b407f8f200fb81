"""The data stage against real chat templates: every assistant turn is trained on exactly what a
server shows the model for it, then exactly what the model writes. The expected texts come from
renderings written out here by hand from each template's documented format, not from
apply_chat_template."""
import builtins
import json
import os
import signal
import sys
import time

import pytest

from dflash_train import chat_data
from dflash_train import demo_assets
from dflash_train import regeneration
from conftest import chat_server, server_args, chat_rows, tiny_tokenizer, write_jsonl

SYSTEM = "You are terse."
CONVERSATION = [  # (user, assistant) pairs; the assistant turns carry think blocks
    ("What is 2+2?", "<think>\nAdd them.\n</think>\n\nIt is 4."),
    ("And 3+3?", "<think>\nAgain.\n</think>\n\n6, of course."),
    ("Name a colour.", "<think>\nPick one.\n</think>\n\nBlue."),
]


def messages(with_system=True, with_think=True):
    out = [{"role": "system", "content": SYSTEM}] if with_system else []
    for q, a in CONVERSATION:
        out += [{"role": "user", "content": q},
                {"role": "assistant", "content": a if with_think else a.split("</think>\n\n")[-1]}]
    return out


def split_think(content):
    if "</think>" not in content:
        return "", content
    return content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n"), \
        content.split("</think>")[-1].lstrip("\n")


# --- independent renderings: (server prompt for the turn, what the model writes) per template ----

def qwen3_turns(msgs, enable_thinking=True):
    out, text = [], ""
    for m in msgs:
        if m["role"] == "assistant":
            prompt = text + "<|im_start|>assistant\n" + ("" if enable_thinking else "<think>\n\n</think>\n\n")
            reasoning, answer = split_think(m["content"])
            reply = f"<think>\n{reasoning}\n</think>\n\n{answer}<|im_end|>"
            out.append((prompt, reply[len(prompt) - len(text) - len("<|im_start|>assistant\n"):]
                        if not enable_thinking else reply))
            text += f"<|im_start|>assistant\n{answer}<|im_end|>\n"  # history: the think block is stripped
        else:
            text += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
    return out


def llama3_turns(msgs):
    out, text = [], "<|begin_of_text|>"
    for m in msgs:
        if m["role"] == "assistant":
            out.append((text + "<|start_header_id|>assistant<|end_header_id|>\n\n", m["content"] + "<|eot_id|>"))
        text += f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content']}<|eot_id|>"
    return out


def gemma3_turns(msgs):
    system = msgs[0]["content"] + "\n\n" if msgs[0]["role"] == "system" else ""
    out, text = [], "<bos>"
    for m in [m for m in msgs if m["role"] != "system"]:
        if m["role"] == "assistant":
            out.append((text + "<start_of_turn>model\n", m["content"] + "<end_of_turn>"))
            text += f"<start_of_turn>model\n{m['content']}<end_of_turn>\n"
        else:
            text += f"<start_of_turn>user\n{system}{m['content']}<end_of_turn>\n"
            system = ""
    return out


RENDERINGS = {"qwen3": qwen3_turns, "llama3_1": llama3_turns, "gemma3": gemma3_turns}


def assert_trained_as_served(tok, docs, turns):
    """Each document's loss spans, in order over the documents, are the turns' replies, and what
    precedes each span in its document is that turn's server prompt, token for token."""
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]
    spans = []
    for ids, mask in docs:
        k = 0
        while k < len(mask):
            if mask[k]:
                e = k
                while e < len(mask) and mask[e]:
                    e += 1
                spans.append((list(ids[:k]), list(ids[k:e])))
                k = e
            else:
                k += 1
    assert len(spans) == len(turns)
    for (context, reply), (prompt_text, reply_text) in zip(spans, turns):
        assert reply == enc(reply_text), (tok.decode(reply), reply_text)
        assert context == enc(prompt_text), (tok.decode(context), prompt_text)


@pytest.mark.parametrize("name", ["qwen3", "llama3_1", "gemma3"])
@pytest.mark.parametrize("with_think", [True, False])
@pytest.mark.parametrize("with_system", [True, False])
def test_every_turn_trained_as_a_server_renders_it(real_tokenizer, name, with_think, with_system):
    tok = real_tokenizer(name)
    msgs = messages(with_system, with_think)
    stats = chat_data.DocumentStats()
    docs = chat_data.conversation_documents(tok, msgs, 4096, {}, stats, "row")
    assert_trained_as_served(tok, docs, RENDERINGS[name](msgs))
    assert stats.counts["trained_turns"] == stats.counts["assistant_turns"] == 3
    assert stats.counts["assistant_tokens"] == sum(sum(m) for _, m in docs)
    # templates that keep history unchanged: one document; Qwen3 rewrites it: one per turn
    assert len(docs) == (3 if name == "qwen3" else 1)


def test_qwen3_thinking_off_is_what_the_server_shows(real_tokenizer):
    tok = real_tokenizer("qwen3")
    msgs = messages(True, with_think=False)
    docs = chat_data.conversation_documents(tok, msgs, 4096, {"enable_thinking": False}, chat_data.DocumentStats(), "row")
    assert_trained_as_served(tok, docs, qwen3_turns(msgs, enable_thinking=False))
    # think blocks in the data but thinking off when served: the reply cannot follow that prompt
    stats = chat_data.DocumentStats()
    docs = chat_data.conversation_documents(tok, messages(True, True), 4096, {"enable_thinking": False}, stats, "row")
    assert stats.skipped_turns == {"rendered turn does not extend the generation prompt": 3} and docs == []


def test_leading_assistant_turn_and_system_prompt_carry_no_loss(real_tokenizer):
    tok = real_tokenizer("llama3_1")
    msgs = [{"role": "assistant", "content": "Hello, how can I help?"}] + messages(True, False)
    stats = chat_data.DocumentStats()
    (ids, mask), = chat_data.conversation_documents(tok, msgs, 4096, {}, stats, "row")
    assert stats.skipped_turns == {"assistant turn before any user turn (dropped)": 1}
    assert "Hello, how can I help?" not in tok.decode(ids)
    trained = tok.decode([t for t, m in zip(ids, mask) if m])
    assert SYSTEM not in trained and "2+2" not in trained
    assert_trained_as_served(tok, [(ids, mask)], llama3_turns(messages(True, False)))


def test_truncation_keeps_the_trained_turn_and_covers_every_reply_token():
    tok = tiny_tokenizer()
    long_history = [{"role": "user", "content": "x" * 150}, {"role": "assistant", "content": "y" * 150},
                    {"role": "user", "content": "q"}, {"role": "assistant", "content": "z" * 40}]
    stats = chat_data.DocumentStats()
    docs = chat_data.conversation_documents(tok, long_history, 64, {}, stats, "row")
    assert all(len(ids) <= 64 for ids, _ in docs)
    trained = "".join(tok.decode([t for t, m in zip(ids, mask) if m]) for ids, mask in docs)
    assert trained == "y" * 150 + "<|end|>" + "z" * 40 + "<|end|>"  # every reply token, once
    last_ids, last_mask = docs[-1]
    # the last turn kept whole, its prompt right before it, the history shortened from the left
    assert tok.decode(last_ids).endswith("<|user|>q<|end|><|assistant|>" + "z" * 40 + "<|end|>")
    assert sum(last_mask) == 41 and len(last_ids) == 64
    assert stats.truncated["history shortened to fit --max-length"] == 1
    assert stats.truncated["split into several documents to fit --max-length"] == 1


def test_cover_windows():
    # 10 prompt tokens then 30 trained; windows of 16 keep a quarter (4) of context each
    mask = [0] * 10 + [1] * 30
    w = chat_data.cover(list(range(40)), mask, 16)
    assert w == [(6, 22, 10), (18, 34, 22), (24, 40, 34)]  # a quarter of context, then all that fits
    assert all(e - s <= 16 for s, e, _ in w)
    trained = [k for s, e, c in w for k in range(c, e) if mask[k]]
    assert trained == list(range(10, 40))  # each trained position once, in order
    assert chat_data.cover(list(range(8)), [0, 0, 1, 1, 1, 1, 1, 1], 16) == [(0, 8, 2)]
    # whole turns where they fit: the second turn is not cut to fill the first window
    two = [0] * 4 + [1] * 6 + [0] * 2 + [1] * 8
    assert chat_data.cover(list(range(20)), two, 16) == [(0, 10, 4), (4, 20, 12)]


def test_skips_and_truncations_are_summarised_not_printed_per_row(tmp_path):
    tok = tiny_tokenizer()
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a" * 100}]}] * 10 + \
        ["{bad"] * 7 + [{"messages": [{"role": "user", "content": "q"}]}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    logged = []
    corpus = chat_data.load_corpus([path], tok, 64, 128, str(tmp_path / "cache"), {}, logged.append)
    s = corpus.stats
    assert s.counts["rows"] == 18 and s.skipped_rows["no assistant turn"] == 1
    assert sum(n for r, n in s.skipped_rows.items() if r.startswith("bad JSON")) == 7
    assert s.truncated == {"split into several documents to fit --max-length": 10}
    assert s.counts["loss_tokens"] == s.counts["assistant_tokens"] == 10 * 101
    assert len(logged) < 8 and any("7 x bad JSON" in m and "d.jsonl:11" in m for m in logged)


def test_tokenising_processes_give_the_documents_and_counts_of_one(tmp_path):
    """Chunks of rows tokenised by forked processes come back in file order: the same documents,
    counts, reasons and examples as one process, whatever the chunk boundaries."""
    from conftest import chat_rows
    tok = tiny_tokenizer()
    multi = {"messages": [{"role": "user", "content": "q one"}, {"role": "assistant", "content": "a " * 40},
                          {"role": "user", "content": "q two"}, {"role": "assistant", "content": "b " * 30}]}
    rows = chat_rows(40) + ["{bad", multi, {"messages": [{"role": "user", "content": "q"}]},
                            {"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1]}, {"input_ids": [1, 2]}] + \
        [multi] * 5 + chat_rows(13, seed=1) + ["{also bad"]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    one = chat_data.read_documents(path, tok, 48, len(tok), {}, workers=1, log=lambda m: None)
    for workers, chunk_rows in ((2, 4), (3, 7), (2, 1000)):
        many = chat_data.read_documents(path, tok, 48, len(tok), {}, workers=workers, chunk_rows=chunk_rows,
                                 log=lambda m: None)
        assert many[0] == one[0] and many[1].to_dict() == one[1].to_dict(), (workers, chunk_rows)
    assert one[1].counts["rows"] == len(rows) and len(one[1].skipped_rows) >= 3
    assert one[1].truncated and one[1].examples  # the chunking has reasons and examples to keep in order


def _killed(lines):  # a tokenising process killed mid-read, as by the OOM killer
    os._exit(1)


def test_a_tokenising_process_that_dies_stops_the_read_rather_than_hanging(tmp_path, monkeypatch):
    from concurrent.futures.process import BrokenProcessPool
    from conftest import chat_rows
    path = write_jsonl(tmp_path / "d.jsonl", chat_rows(40))
    monkeypatch.setattr(chat_data, "_read_chunk", _killed)
    with pytest.raises(BrokenProcessPool):
        chat_data.read_documents(path, tiny_tokenizer(), 48, 128, {}, workers=2, chunk_rows=4, log=lambda m: None)


SIGNALLED = None  # a directory: the pids of the workers _signal_the_reader ran in, and who signalled


def _signal_the_reader(lines):
    """In a tokenising worker: note the worker, have the first one SIGTERM the reading process,
    and never finish the chunk."""
    with open(os.path.join(SIGNALLED, "pids"), "a") as f:
        f.write(f"{os.getpid()}\n")
    try:
        os.close(os.open(os.path.join(SIGNALLED, "signalled"), os.O_CREAT | os.O_EXCL))
        os.kill(os.getppid(), signal.SIGTERM)
    except FileExistsError:
        pass
    time.sleep(60)


def test_a_signal_while_tokenising_stops_the_read_and_leaves_no_worker(tmp_path, monkeypatch):
    """SIGTERM (or SIGINT) to the reading process while its workers tokenise: the read stops, and
    every worker is gone with it, none left holding a tokenizer's memory."""
    monkeypatch.setattr(sys.modules[__name__], "SIGNALLED", str(tmp_path))  # read by the forked workers
    monkeypatch.setattr(chat_data, "_read_chunk", _signal_the_reader)
    path = write_jsonl(tmp_path / "d.jsonl", chat_rows(40))
    with pytest.raises(KeyboardInterrupt):
        chat_data.read_documents(path, tiny_tokenizer(), 48, 128, {}, workers=2, chunk_rows=4, log=lambda m: None)
    pids = [int(pid) for pid in (tmp_path / "pids").read_text().split()]
    assert pids
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_cache_key_covers_tokenizer_contents_and_template_options(tmp_path):
    tok = tiny_tokenizer()
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x"}])
    key = lambda t, kw: chat_data.corpus_cache_key([path], t, 64, 128, kw)
    base = key(tok, {})
    assert key(tok, {"enable_thinking": False}) != base
    other = tiny_tokenizer()
    other.chat_template = other.chat_template.replace("<|end|>", "<|end|>\n")
    assert key(other, {}) != base
    other = tiny_tokenizer()
    other.add_tokens(["<new>"])
    assert key(other, {}) != base
    assert key(tiny_tokenizer(), {}) == base


def test_a_data_file_edited_in_place_is_tokenised_anew_and_a_torn_cache_rebuilt(tmp_path):
    """The corpus cache is keyed by the data's contents: an edit that keeps the file's size and
    modification time is new data, not the old corpus. A cache file cut short (a kill or a full
    disk mid-write) is said and rebuilt, not a failure of every later run."""
    tok, said = tiny_tokenizer(), []
    load = lambda path: chat_data.load_corpus([str(path)], tok, 128, 128, str(tmp_path / "cache"), log=said.append)
    rows = [{"messages": [{"role": "user", "content": "a cat"}, {"role": "assistant", "content": w}]}
            for w in ("the dog sat", "a mat ran")]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    first = load(path)
    stat = os.stat(path)
    edited = [dict(r) for r in rows]
    edited[0] = {"messages": [{"role": "user", "content": "a cat"}, {"role": "assistant", "content": "the cat sat"}]}
    write_jsonl(path, edited)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.stat(path).st_size == stat.st_size and os.stat(path).st_mtime_ns == stat.st_mtime_ns
    said.clear()
    second = load(path)
    assert not any("from cache" in m for m in said), said
    assert second.fingerprint() != first.fingerprint()
    assert tok.decode(second.doc(0)[0]).count("cat") == 2
    # the same contents again: the cache serves it
    said.clear()
    assert load(path).fingerprint() == second.fingerprint() and any("from cache" in m for m in said)
    cache = tmp_path / "cache" / f"corpus_{chat_data.corpus_cache_key([str(path)], tok, 128, 128, None)}.npz"
    cache.write_bytes(cache.read_bytes()[:200])
    said.clear()
    assert load(path).fingerprint() == second.fingerprint()
    assert any("cannot be read" in m and "tokenising anew" in m for m in said), said


def test_inspect_data_dumps_what_the_pipeline_trains(tmp_path, capsys):
    from scripts import inspect_data
    from conftest import chat_rows
    tok = tiny_tokenizer()
    tok_dir = tmp_path / "tok"
    tok.save_pretrained(tok_dir)
    path = write_jsonl(tmp_path / "d.jsonl", chat_rows(20) + ["{bad"])
    dump = tmp_path / "docs.jsonl"
    assert inspect_data.main(["--tokenizer", str(tok_dir), "--data", path, "--max-length", "256",
                              "--dump", str(dump), "--show", "2"]) == 0
    out = capsys.readouterr().out
    assert "21 rows (1 skipped)" in out and "carry loss" in out and "bad JSON" in out
    assert out.count("--- document") == 2 and "[[" in out and "<|end|>]]" in out
    dumped = [json.loads(l) for l in dump.read_text().splitlines()]
    corpus = chat_data.load_corpus([path], tok, 256, len(tok), str(tmp_path / "cache"), {}, lambda m: None)
    assert len(dumped) == len(corpus)
    for i, d in enumerate(dumped):
        ids, mask = corpus.doc(i)
        assert d["input_ids"] == ids.tolist() and d["loss_mask"] == mask.tolist()


def test_inspect_data_replays_prompt_lookup_over_each_trained_span(tmp_path, capsys):
    """A span that repeats the document before it: one block gains the 5 tokens that followed
    the anchor's earlier occurrence plus its own (6), and the 7-token span is done; a span with
    nothing to copy gains 1 a block. Worked by hand (lookup: the most recent earlier match of the
    last 3, 2, then 1 tokens; the first token of a span comes with its prompt)."""
    from scripts import inspect_data
    ids = [5, 6, 7, 8, 9] + [5, 6, 7, 8, 9, 5, 6] + [100] + [200, 201, 202]
    mask = [0] * 5 + [1] * 7 + [0] + [1] * 3
    assert inspect_data.lookup_gains(ids, mask) == [[6], [1, 1]]
    line = inspect_data.lookup_summary([(True, [6]), (False, [1, 1])])
    assert "acceptance 2.67 (first span of a document 6.00, later spans 1.00); 0.0% of the tokens in whole blocks" in line
    assert "100.0% of the tokens in whole blocks" in inspect_data.lookup_summary([(True, [16, 16])])
    from conftest import chat_rows
    tok_dir = tmp_path / "tok"
    tiny_tokenizer().save_pretrained(tok_dir)
    path = write_jsonl(tmp_path / "d.jsonl", chat_rows(5))
    assert inspect_data.main(["--tokenizer", str(tok_dir), "--data", path, "--lookup"]) == 0
    assert "prompt lookup replayed over the trained spans: acceptance" in capsys.readouterr().out


# --- mask token ------------------------------------------------------------------------------


# --- Gemma: a target that scales its embedding ------------------------------------------------


# --- target layers ----------------------------------------------------------------------------


def test_builtin_prompts_keep_the_demo_conversations_first_then_add_the_long_ones(tmp_path, monkeypatch):
    """builtin:sharegpt-prompts = the demo's conversations (at most 6000 characters with their
    original replies), line for line, so rows regenerated from them keep their ids; then the
    ones left out only for their long replies (user turns of at most 4000 characters)."""
    def conv(user, reply, first="hi"):
        return {"conversations": [{"from": "human", "value": first + user}, {"from": "gpt", "value": reply}]}
    rows = [conv("a", "short"), conv("b", "x" * 7000), conv("c", "x" * 7000, first="é"), conv("d", "ok"),
            {"conversations": [{"from": "human", "value": "u" * 4500}, {"from": "gpt", "value": "x" * 3000}]},
            conv("e", "fine")]
    (tmp_path / "share.json").write_text(json.dumps(rows))
    monkeypatch.setattr(demo_assets, "CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(demo_assets, "package_file", lambda name: str(tmp_path / "share.json"))
    demo = [json.loads(l) for l in open(demo_assets.builtin_data(demo_assets.BUILTIN_DATA))]
    assert demo == [rows[0], rows[3], rows[5]]  # at most 6000 characters, ASCII first turn
    prompts = [json.loads(l) for l in open(demo_assets.builtin_data(demo_assets.BUILTIN_PROMPTS))]
    assert prompts == [rows[0], rows[3], rows[5], rows[1]]  # then the long reply; not é, not 4500 user chars
    assert demo_assets.builtin_data("my.jsonl") == "my.jsonl"


def test_publish_directory_second_process_takes_the_first_copy(tmp_path):
    # Two runs started together each convert the built-in model; the later one keeps the first copy.
    out = tmp_path / "model"
    first, second = tmp_path / "model.tmp1", tmp_path / "model.tmp2"
    for d, text in ((first, "first"), (second, "second")):
        d.mkdir()
        (d / "config.json").write_text(text)
    assert demo_assets.publish_directory(str(first), str(out), "config.json") == str(out)
    assert demo_assets.publish_directory(str(second), str(out), "config.json") == str(out)
    assert (out / "config.json").read_text() == "first" and not second.exists() and not first.exists()
    # a non-empty directory without the marker is not a finished copy: the error stands
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "partial.bin").write_text("x")
    third = tmp_path / "model.tmp3"
    third.mkdir()
    (third / "config.json").write_text("third")
    with pytest.raises(OSError):
        demo_assets.publish_directory(str(third), str(tmp_path / "broken"), "config.json")


def loaded_corpus(paths, cache, fields=None):
    return chat_data.load_corpus([str(p) for p in paths], tiny_tokenizer(), 128, 128, str(cache), log=lambda m: None,
                                 fields=fields)


def format_rows():
    from conftest import chat_rows
    return chat_rows(12)


def test_a_json_array_file_gives_the_jsonl_corpus(tmp_path):
    rows = format_rows()
    jsonl = write_jsonl(tmp_path / "d.jsonl", rows)
    (tmp_path / "d.json").write_text(json.dumps(rows, indent=1))
    want = loaded_corpus([jsonl], tmp_path / "c1")
    got = loaded_corpus([tmp_path / "d.json"], tmp_path / "c2")
    assert got.fingerprint() == want.fingerprint() and len(got) == len(want) > 0


def test_compressed_and_byte_order_marked_files_give_the_jsonl_corpus(tmp_path):
    """gzip, bzip2 and xz files are read as the file they hold; a UTF-8 byte-order mark in front of
    a JSONL file or a JSON array is dropped; zstd (not in the standard library) is named."""
    import bz2
    import gzip
    import lzma
    rows = format_rows()
    jsonl = write_jsonl(tmp_path / "d.jsonl", rows)
    want = loaded_corpus([jsonl], tmp_path / "c").fingerprint()
    raw = open(jsonl, "rb").read()
    files = {"d.jsonl.gz": gzip.compress(raw), "d.jsonl.bz2": bz2.compress(raw), "d.jsonl.xz": lzma.compress(raw),
             "bom.jsonl": b"\xef\xbb\xbf" + raw, "bom.json": b"\xef\xbb\xbf" + json.dumps(rows).encode(),
             "d.json.gz": gzip.compress(json.dumps(rows, indent=1).encode())}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        got = loaded_corpus([tmp_path / name], tmp_path / f"c-{name}")
        assert got.fingerprint() == want and not got.stats.skipped_rows, name
    (tmp_path / "d.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd" + raw)
    with pytest.raises(chat_data.UsageError, match="a zstd-compressed file; decompress it first"):
        loaded_corpus([tmp_path / "d.jsonl.zst"], tmp_path / "c-zst")


def test_a_json_object_file_is_a_sentence_not_thousands_of_bad_lines(tmp_path):
    (tmp_path / "d.json").write_text(json.dumps({"version": 1, "data": format_rows()}, indent=2))
    with pytest.raises(chat_data.UsageError, match=r"one JSON object, not rows: give JSONL \(one row a line\) or a "
                       r"JSON array of rows \(its 'data' field holds 12 rows\)"):
        loaded_corpus([tmp_path / "d.json"], tmp_path / "c")


def test_a_template_that_fails_on_every_turn_is_named_in_the_refusal(tmp_path):
    tok = tiny_tokenizer()
    tok.chat_template = "{{ raise_exception('roles must alternate user/assistant') }}"
    path = write_jsonl(tmp_path / "d.jsonl", format_rows())
    with pytest.raises(chat_data.UsageError, match="no usable documents.*assistant turns skipped: chat template "
                       "error: roles must alternate user/assistant"):
        chat_data.load_corpus([path], tok, 128, 128, str(tmp_path / "c"), log=lambda m: None)


def test_parquet_and_a_saved_dataset_give_the_jsonl_corpus(tmp_path):
    pytest.importorskip("pyarrow")
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [r for r in format_rows() if "messages" in r]  # one schema a table
    jsonl = write_jsonl(tmp_path / "d.jsonl", rows)
    want = loaded_corpus([jsonl], tmp_path / "c0").fingerprint()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert loaded_corpus([tmp_path / "d.parquet"], tmp_path / "c1").fingerprint() == want
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    assert loaded_corpus([tmp_path / "saved"], tmp_path / "c2").fingerprint() == want
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "splits"))
    assert loaded_corpus([tmp_path / "splits"], tmp_path / "c3").fingerprint() == want
    # rows of both schemas in one table: a row's empty columns are not its fields
    mixed = format_rows()
    columns = {k: [r.get(k) for r in mixed] for k in ("messages", "conversations")}  # from_pylist reads the first row's keys
    pq.write_table(pa.table(columns), tmp_path / "mixed.parquet")
    assert loaded_corpus([tmp_path / "mixed.parquet"], tmp_path / "c4").fingerprint() == \
        loaded_corpus([write_jsonl(tmp_path / "mixed.jsonl", mixed)], tmp_path / "c5").fingerprint()


def test_data_fields_map_other_names_and_formats_mix_in_globs(tmp_path):
    rows = format_rows()
    renamed = [{"conversation": r["messages"]} if "messages" in r else r for r in rows]
    write_jsonl(tmp_path / "a.jsonl", renamed[:6])
    (tmp_path / "b.json").write_text(json.dumps(renamed[6:]))
    want = loaded_corpus([write_jsonl(tmp_path / "all.jsonl", rows)], tmp_path / "c0").fingerprint()
    paths = chat_data.expand_data_paths([str(tmp_path / "a.jsonl"), str(tmp_path / "b.*")])
    fields = chat_data.parse_data_fields("messages=conversation")
    assert loaded_corpus(paths, tmp_path / "c1", fields).fingerprint() == want
    without = loaded_corpus(paths, tmp_path / "c2")  # unmapped: those rows are counted skips, not guessed
    assert without.stats.skipped_rows == {"no 'messages', 'conversations' or 'input_ids'": 6}
    with pytest.raises(chat_data.UsageError, match="NAME=FIELD"):
        chat_data.parse_data_fields("message=conversation")


def test_a_missing_optional_reader_is_a_sentence(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_pyarrow(name, *a, **k):
        if name.startswith("pyarrow"):
            raise ImportError(name)
        return real_import(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    with pytest.raises(chat_data.UsageError, match="needs the pyarrow package"):
        chat_data.numbered_rows(str(tmp_path / "d.parquet"))


# --- reasoning, tool calls, tool turns and a tools schema, trained as served -------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}


def agent_messages():
    """An agent conversation as a server keeps it (OpenAI fields): a reasoned tool call with null
    content, the tool's result, a reasoned answer, then a plain follow-up."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    return [{"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "reasoning_content": "I should call the tool.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": '{"temp": 21}'},
            {"role": "assistant", "reasoning": "It is 21.", "content": "It is 21 degrees in Paris."},
            {"role": "user", "content": "Thanks!"},
            {"role": "assistant", "content": "You're welcome."}]


def qwen3_agent_turns(tools):
    """Qwen3's rendering of agent_messages(), written out by hand: the tools in the system turn;
    the turns after the last user query keep their reasoning, earlier ones lose it; a tool
    result is a user turn of <tool_response>; an assistant turn's tool call is <tool_call> JSON."""
    system = ("<|im_start|>system\nYou are helpful.\n\n# Tools\n\nYou may call one or more functions to assist with "
              "the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
              + json.dumps(tools[0], ensure_ascii=False) + "\n</tools>\n\nFor each function call, return a json object "
              "with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
              "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n")
    user1 = "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    reply1 = "<think>\nI should call the tool.\n</think>\n\n" + call + "<|im_end|>"
    tool = "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>\n"
    reply2 = "<think>\nIt is 21.\n</think>\n\nIt is 21 degrees in Paris.<|im_end|>"
    # once a new user query follows, the earlier turns lose their reasoning
    history = system + user1 + "<|im_start|>assistant\n" + call + "<|im_end|>\n" + tool + \
        "<|im_start|>assistant\nIt is 21 degrees in Paris.<|im_end|>\n"
    return [(system + user1 + "<|im_start|>assistant\n", reply1),
            (system + user1 + "<|im_start|>assistant\n" + reply1 + "\n" + tool + "<|im_start|>assistant\n", reply2),
            (history + "<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n",
             "<think>\n\n</think>\n\nYou're welcome.<|im_end|>")]


# A template that prints a tool call's arguments with `tojson`, as Llama 3.1's does
TOJSON_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m.tool_calls %}{% for c in m.tool_calls %}{\"name\": \""
    "{{ c.function.name }}\", \"parameters\": {{ c.function.arguments | tojson }}}{% endfor %}{% else %}"
    "{{ m['content'] }}{% endif %}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def trained_texts(corpus, tok):
    """What each document trains (its loss-masked tokens), decoded."""
    return [tok.decode([t for t, m in zip(*corpus.doc(i)) if m]) for i in range(len(corpus))]


def test_tool_call_arguments_are_trained_as_the_object_a_server_renders(tmp_path):
    """vLLM parses a tool call's JSON-string arguments into a mapping before the template renders
    it (an empty one is {}): a `tojson` template then prints the object, as the model writes it,
    not a string of it. In Parquet, Arrow gives each row's arguments every other row's keys as
    null: they are not the row's, and are not trained. The expected texts are written out here."""
    tok = tiny_tokenizer()
    tok.chat_template = TOJSON_TEMPLATE

    def row(arguments, city="Paris"):
        call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        return {"messages": [{"role": "user", "content": f"Weather in {city}?"},
                             {"role": "assistant", "content": None, "tool_calls": [call]}]}
    path = write_jsonl(tmp_path / "d.jsonl", [row('{"city": "Paris"}'), row({"city": "Paris"}), row(""),
                                              row("{not json")])
    corpus = chat_data.load_corpus([path], tok, 128, 128, str(tmp_path / "cache"), log=lambda m: None)
    want = '{"name": "get_weather", "parameters": {"city": "Paris"}}<|end|>'
    assert trained_texts(corpus, tok) == [want, want, '{"name": "get_weather", "parameters": {}}<|end|>']
    assert corpus.stats.skipped_rows == {"tool_calls[0].function.arguments is neither JSON nor a mapping": 1}
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    rows = [row({"city": "Paris"}), row({"city": "Rome", "units": "C"}, "Rome")]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    corpus = chat_data.load_corpus([str(tmp_path / "d.parquet")], tok, 128, 128, str(tmp_path / "cache"),
                                   log=lambda m: None)
    assert trained_texts(corpus, tok) == [
        want, '{"name": "get_weather", "parameters": {"city": "Rome", "units": "C"}}<|end|>']


def test_reasoning_and_tool_calls_trained_as_the_server_renders_them(real_tokenizer, tmp_path):
    tok = real_tokenizer("qwen3")
    row = {"messages": agent_messages(), "tools": [WEATHER]}
    stats = chat_data.DocumentStats()
    docs = chat_data.row_documents(row, tok, 4096, 151936, {}, stats, "row")
    assert_trained_as_served(tok, docs, qwen3_agent_turns([WEATHER]))
    # the tool call's turn and its answer share a document (the history kept its reasoning); the
    # follow-up, after which the template drops earlier reasoning, starts its own
    assert len(docs) == 2 and stats.counts["trained_turns"] == 3 and not stats.skipped_turns
    # the tool result and the system/user turns carry no loss: the trained text is the model's alone
    trained = tok.decode([t for ids, mask in docs for t, m in zip(ids, mask) if m])
    assert "tool_response" not in trained and "Weather in Paris" not in trained and trained.count("<tool_call>") == 1


def test_a_template_that_drops_tool_calls_or_reasoning_skips_those_turns(real_tokenizer):
    # The Llama 3.1 template shipped with this tokenizer renders content only: a turn whose tool
    # call or reasoning it would drop cannot be trained as the model wrote it; it is counted.
    tok = real_tokenizer("llama3_1")
    stats = chat_data.DocumentStats()
    docs = chat_data.row_documents({"messages": agent_messages(), "tools": [WEATHER]}, tok, 4096, 128256, {}, stats,
                                   "row")
    assert stats.skipped_turns == {"the chat template does not render reasoning_content or tool_calls": 1,
                                   "the chat template does not render reasoning_content": 1}
    assert stats.counts["trained_turns"] == 1 and len(docs) == 1


def test_tool_and_reasoning_fields_are_checked_and_counted(real_tokenizer):
    tok = real_tokenizer("qwen3")
    for row, reason in (({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a",
                                                                            "tool_calls": "call it"}]},
                         "tool_calls of an assistant turn is not a list of objects"),
                        ({"messages": agent_messages(), "tools": "weather"}, "tools is not a list of objects")):
        with pytest.raises(chat_data.BadRow, match=reason):
            chat_data.row_documents(row, tok, 4096, 151936, {}, chat_data.DocumentStats(), "row")


def test_server_regeneration_keeps_reasoning_and_tool_calls_and_the_datas_tool_turns(tmp_path):
    """A stub OpenAI-compatible server answers with a reasoning parser's fields and a tool call:
    they are written back as the message's fields; the data's tool result follows, then the
    answer to it; the tools schema goes with each request."""
    requests = []

    def answer(body):
        requests.append(body)
        last = body["messages"][-1]
        message = ({"role": "assistant", "content": None, "reasoning": "I need the weather.",
                    "tool_calls": [{"id": "x", "type": "function",
                                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}
                   if last["role"] == "user" else {"role": "assistant", "content": "21 degrees.",
                                                   "reasoning_content": "The tool said 21."})
        return 200, {"choices": [{"message": message, "finish_reason": "stop"}], "usage": {"completion_tokens": 5}}
    data = [m for m in agent_messages()[:5] if m["role"] != "assistant"]
    inp = write_jsonl(tmp_path / "in.jsonl", [{"messages": data, "tools": [WEATHER]}])
    with chat_server(answer) as url:
        summary = regeneration.regenerate(inp, str(tmp_path / "out.jsonl"),
                                          lambda progress: regeneration.ServerBackend(url, server_args(), progress),
                                          {}, log=lambda m: None)
    assert summary["rows"] == 1 and summary["turns"] == 2
    row = json.loads((tmp_path / "out.jsonl").read_text())
    roles = [m["role"] for m in row["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant"] and row["tools"] == [WEATHER]
    call, answer = row["messages"][2], row["messages"][4]
    assert call["reasoning_content"] == "I need the weather." and call["tool_calls"][0]["function"]["name"] == \
        "get_weather" and call["content"] == ""
    assert answer == {"role": "assistant", "content": "21 degrees.", "reasoning_content": "The tool said 21."}
    assert all(r["tools"] == [WEATHER] for r in requests) and requests[1]["messages"][3]["role"] == "tool"


# --- every common architecture: exact, or refused before training -----------------------------


def test_rows_that_are_not_utf8_are_counted_skips(tmp_path):
    from conftest import tiny_tokenizer
    good = json.dumps(chat_rows(1)[0]).encode()
    path = tmp_path / "d.jsonl"
    path.write_bytes(good + b"\n" + good.replace(b"cat", b"c\xff\xfet") + b"\n")
    docs, stats = chat_data.read_documents(str(path), tiny_tokenizer(), 128, 128)
    assert stats.skipped_rows == {"not UTF-8 text": 1} and stats.examples["not UTF-8 text"] == ["d.jsonl:2"]
    assert all(0xFFFD not in ids for ids, _ in docs)


@pytest.mark.parametrize("row", [{"messages": None}, "a string", [1, 2], {"input_ids": "12", "loss_mask": [1, 1]},
                                 {"input_ids": [1, 2], "loss_mask": 5}, {"messages": ["hi"]}])
def test_a_badly_typed_row_is_a_counted_skip(tmp_path, row):
    from conftest import tiny_tokenizer
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps(chat_rows(1)[0]) + "\n")
    docs, stats = chat_data.read_documents(str(path), tiny_tokenizer(), 128, 128)
    (tmp_path / "good.jsonl").write_text(json.dumps(chat_rows(1)[0]) + "\n")
    assert docs == chat_data.read_documents(str(tmp_path / "good.jsonl"), tiny_tokenizer(), 128, 128)[0]
    assert sum(stats.skipped_rows.values()) == 1
    assert next(iter(stats.examples.values())) == ["d.jsonl:1"]
