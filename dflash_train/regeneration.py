"""Regeneration: the training data in the target's own words.

Every assistant turn of a conversation is written anew by the target, given the conversation
so far with its earlier turns already regenerated; a round is one turn index, batched across
all conversations of a chunk. Two backends give the same rows: the embedded engine
(decoding.generate, one replica per GPU in threads) and an OpenAI-compatible chat-completions
server. Output rows are appended as each conversation ends, so a killed run resumes.
"""

import argparse
import hashlib
import json
import os
import re
import threading
import time
import traceback
from collections import Counter, deque

import torch

from dflash_train.helpers import signals_handled
from dflash_train.chat_data import BadRow, DocumentStats, Progress, jsonl_rows, prompt_ids, row_to_messages, row_tools
from dflash_train.decoding import generate
from dflash_train import demo_assets
from dflash_train.helpers import text_config
from dflash_train.target_model import load_full_target, load_tokenizer, stop_token_ids

def prompt_key(asks):
    """A row's identity by content: a hash of the turns regeneration answers."""
    return hashlib.sha256(json.dumps(asks, sort_keys=True).encode()).hexdigest()[:16]


def asked(messages):
    """How many assistant turns a conversation asks for: one after each user turn, and one after
    each run of tool turns (the answer to the tools' results)."""
    return sum(m["role"] == "user" or (m["role"] == "tool" and (k == 0 or messages[k - 1]["role"] != "tool"))
               for k, m in enumerate(messages))


def regeneration_prompts(path, done):
    """(rows to do [(id, key, messages without assistant turns)], DocumentStats of skips). A row
    is done when the output holds its line number with its prompt_key (done: {id: key}; None for
    rows written without a key, matched by position alone); a row whose line the output holds
    with another key comes from another input, and is refused (ValueError). Leading assistant
    turns are dropped (no request precedes them); rows without a user turn skipped."""
    todo, stats, other = [], DocumentStats(), []
    for lineno, where, row in jsonl_rows(path, stats):
        try:
            messages = row_to_messages(row if isinstance(row, dict) else {}, require_assistant=False)
            tools = row_tools(row)
        except BadRow as e:
            stats.note(stats.skipped_rows, str(e), where)
            continue
        asks = [m for m in messages if m["role"] != "assistant"]
        if not any(m["role"] == "user" for m in asks):
            stats.note(stats.skipped_rows, "no user turn", where)
            continue
        key = prompt_key(asks if tools is None else [asks, tools])
        if lineno in done and done[lineno] not in (key, None):
            other.append(where)
        elif lineno not in done:
            todo.append((lineno, key, asks, tools))
    if other:
        raise ValueError(f"the output holds answers to other prompts than {len(other)} rows of {path} have "
                         f"(e.g. {', '.join(other[:3])}): it was written from another input; write to another output")
    return todo, stats


class Regeneration:
    """One conversation being regenerated: its messages so far (`outs`), the user, tool and system
    turns still to come (`rest`), its tools schema, why it failed, if it did, and why it was
    skipped, if it was."""

    def __init__(self, row_id, key, asks, tools=None):
        self.row_id, self.key, self.outs, self.rest, self.tools = row_id, key, [], list(asks), tools
        self.error = self.skip = None

    def next_turn(self):
        """Moves the next user turn, or the next run of tool turns (the data's tool results: a
        next turn that depends on them keeps them), with the system turns before it, into outs;
        False if none is left (the trailing system turns moved all the same)."""
        while self.rest and self.rest[0]["role"] == "system":
            self.outs.append(self.rest.pop(0))
        if not self.rest:
            return False
        turn = self.rest.pop(0)
        self.outs.append(turn)
        while turn["role"] == "tool" and self.rest and self.rest[0]["role"] == "tool":
            self.outs.append(self.rest.pop(0))
        return True


def regenerate_rounds(backend, todo, window, summary, progress=None):
    """Every conversation of todo ([(id, prompt key, messages without assistant turns, tools)])
    with an assistant turn after each user turn and each run of tool turns, written by
    backend([(messages, tools)]) -> [(the assistant message's fields {content, and where the
    model wrote them reasoning_content, tool_calls} or None if it failed, finish reason or the
    error, tokens)], each turn given the conversation so far. In
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
        for c, (message, reason, n) in zip(asking, backend([(c.outs, c.tools) for c in asking]) if asking else []):
            if reason == "context":
                summary["finish"][reason] += 1
                while c.outs and c.outs[-1]["role"] != "assistant":  # the turn left unanswered
                    c.outs.pop()
                if progress is not None:  # it and the conversation's later turns will not come
                    progress(1 + asked(c.rest), 0)
                c.rest = []
                if not any(m["role"] == "assistant" for m in c.outs):
                    c.skip = "first prompt longer than the context limit"
            elif message is None:
                c.error, c.rest = reason, []
            else:
                c.outs.append({"role": "assistant", **message})
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
        window = getattr(text_config(self.replicas[0].config), "max_position_embeddings", None) or 10**9
        self.max_context = getattr(args, "max_context_tokens", 0) or max(window - args.max_new_tokens, 1)

    def __call__(self, conversations):
        a = self.args
        ids = [prompt_ids(self.tokenizer, c, a.chat_template_kwargs, tools) for c, tools in conversations]
        results, errors = [None] * len(ids), []
        for i, p in enumerate(ids):
            if len(p) >= self.max_context:
                results[i] = ([], "context")
        todo = [i for i, r in enumerate(results) if r is None]
        shares = [todo[k::len(self.replicas)] for k in range(len(self.replicas))]

        def run(replica, share, seed):
            try:
                out = generate(replica, [ids[i] for i in share], a.max_new_tokens, self.stop, a.batch_size,
                                  a.temperature, a.top_p, seed, progress=self.progress,
                                  decode_attention=a.decode_attention)
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
        # the reply as text: think blocks and tool-call text as the model wrote them, which the
        # template renders back as they were
        return [(None if reason == "context" else {"content": self.tokenizer.decode(t, skip_special_tokens=True)},
                 reason, len(t)) for t, reason in results]


def assistant_fields(message):
    """The fields of a server's assistant message that the model wrote: content (null -> ""),
    reasoning_content (a reasoning parser's `reasoning_content` or `reasoning`), tool_calls."""
    out = {"content": message.get("content") or ""}
    reasoning = message.get("reasoning_content", message.get("reasoning"))
    if reasoning:
        out["reasoning_content"] = reasoning
    if message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
    return out


# How servers say a prompt does not fit the context (vLLM, SGLang, llama.cpp, the OpenAI API)
CONTEXT_ERROR = re.compile(r"context length|context size|context window|maximum context|too long|exceeds the (model|"
                           r"available)", re.IGNORECASE)


def answer_choice(response):
    """(the first choice of a chat-completions answer, its completion tokens, None), or (None, 0,
    why there is none): an answer that is not JSON, has no choices, or a choice without a
    message is said as such."""
    try:
        answer = response.json()
    except ValueError:
        return None, 0, f"the server's answer is not JSON: {response.text[:200]}"
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not choices or not isinstance(choices[0], dict):
        return None, 0, "the server's answer has no choices"
    if not isinstance(choices[0].get("message"), dict):
        return None, 0, "the server's answer has a choice without a message"
    return choices[0], (answer.get("usage") or {}).get("completion_tokens", 0), None


class ServerBackend:
    """An OpenAI-compatible chat-completions endpoint (vllm serve, SGLang, llama.cpp server):
    `concurrency` requests in flight, each retried with exponential backoff. A conversation that
    still fails is given as None (the caller writes it to the rejects file). The reply's
    reasoning (`reasoning_content`, or `reasoning`, from a server's reasoning parser) and
    `tool_calls` are kept as the message's fields."""

    def __init__(self, url, args, progress=None):
        import httpx
        self.url = url.rstrip("/") + ("" if url.rstrip("/").endswith("/chat/completions") else "/chat/completions")
        self.args, self.progress = args, progress
        self.client = httpx.Client(timeout=args.timeout)

    def complete(self, conversation):
        messages, tools = conversation
        a = self.args
        body = {"model": a.server_model, "messages": messages, "max_tokens": a.max_new_tokens,
                "temperature": a.temperature, "top_p": a.top_p, "seed": a.seed}
        if tools is not None:
            body["tools"] = tools
        if a.chat_template_kwargs:
            body["chat_template_kwargs"] = a.chat_template_kwargs
        error = None
        for attempt in range(a.retries + 1):
            if attempt:
                time.sleep(min(a.backoff * 2 ** (attempt - 1), 30))
            try:
                r = self.client.post(self.url, json=body)
            except Exception as e:  # timeouts, refused connections
                error = f"{type(e).__name__}: {e}"
                continue
            if r.status_code == 200:
                choice, n, error = answer_choice(r)
                if choice is not None:
                    if self.progress is not None:
                        self.progress(1, n)
                    return assistant_fields(choice["message"]), choice.get("finish_reason") or "stop", n
                continue  # an answer without one: asked again
            if r.status_code == 400 and CONTEXT_ERROR.search(r.text):
                return None, "context", 0  # the history is too long to answer: the turns before it stand
            error = f"HTTP {r.status_code}: {r.text[:200]}"
            if r.status_code < 500 and r.status_code != 429:
                break  # a request the server refuses will be refused again
        return None, error, 0

    def __call__(self, conversations):
        """Every conversation's answer, `concurrency` requests at a time, in daemon threads that
        the main thread joins a fraction of a second at a time: a signal reaches it at once, and a
        second Ctrl-C ends the process without waiting out a hanging server's requests."""
        results, todo, lock = [None] * len(conversations), iter(enumerate(conversations)), threading.Lock()

        def work():
            while True:
                with lock:
                    i, conversation = next(todo, (None, None))
                if i is None:
                    return
                results[i] = self.complete(conversation)
        threads = [threading.Thread(target=work, daemon=True) for _ in range(min(self.args.concurrency,
                                                                                 len(conversations)))]
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.2)
        return results


def done_regeneration_ids(path):
    """{id: prompt key (None where the row has none)} of the rows already written; a last line
    cut off by a kill is cut away (it is regenerated)."""
    done = {}
    if os.path.exists(path):
        with open(path, "rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                f.truncate(data.rfind(b"\n") + 1)
        with open(path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                    done[row["id"]] = row.get("key")
                except (json.JSONDecodeError, KeyError):
                    pass
    return done


def settings_record(output, settings):
    """Checks the settings an output was written with (kept beside it, <output>.settings.json)
    against these, or records them for a new output: a resume with another target, template
    options or generation length would mix two kinds of answers in one file. ValueError naming
    each difference."""
    path, settings = output + ".settings.json", json.loads(json.dumps(settings))
    if os.path.exists(path):
        with open(path) as f:
            recorded = json.load(f)
        diff = [f"{k} {recorded.get(k)!r} -> {settings.get(k)!r}" for k in sorted(set(recorded) | set(settings))
                if recorded.get(k) != settings.get(k)]
        if diff:
            raise ValueError(f"{output} was written with other settings ({'; '.join(diff)}): its conversations and "
                             "new ones would mix; rerun with the settings it was written with, or write to another "
                             "--output")
        return
    if os.path.exists(output) and os.path.getsize(output):
        raise ValueError(f"{output} holds conversations but no record of the settings they were written with ({path}):"
                         " write to another --output")
    with open(path + ".tmp", "w") as f:
        json.dump(settings, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)


def regenerate(input_path, output, make_backend, settings, window=4096, log=print, desc="regenerating"):
    """Regenerate every row of input_path not yet in output (regenerate_rounds, `window`
    conversations at a time), appending each conversation to output as soon as it is done (so a
    kill loses only those in progress; a rerun resumes). make_backend(progress) gives the
    backend. Rows whose generation failed go to <output>.rejects.jsonl with the reason; rows
    with nothing to answer within the context limit are counted skips. SIGINT (in the main
    thread) stops after the round under way, every finished conversation written; a second one
    stops at once. settings: what defines the answers (target, template options, sampling,
    lengths), recorded beside the output and checked on a resume (settings_record). Returns the
    summary dict (with a one-line `text`; `interrupted`)."""
    settings_record(output, settings)
    todo, skipped = regeneration_prompts(input_path, done_regeneration_ids(output))
    for line in skipped.summary()[1:]:
        log(f"input: {line.strip()}")
    progress = Progress(sum(asked(c) for _, _, c, _ in todo), desc, log)
    t0 = time.perf_counter()
    backend = make_backend(progress)
    rejects = output + ".rejects.jsonl"
    summary = {"rows": 0, "turns": 0, "tokens": 0, "finish": Counter(), "rejected": 0, "rejects": rejects,
               "skipped": Counter(skipped.skipped_rows), "interrupted": False}

    def on_signal(signum):
        if summary["interrupted"]:  # the second: at once
            raise KeyboardInterrupt
        summary["interrupted"] = True
        log(f"signal {signum}: stopping after the round under way (again to stop at once); a rerun resumes")
    with signals_handled(on_signal):
        with open(output, "a") as out, open(rejects, "a") as bad:
            for finished in regenerate_rounds(backend, todo, window, summary, progress):
                for c in finished:
                    if c.skip is not None:
                        summary["skipped"][c.skip] += 1
                    elif c.error is not None:
                        summary["rejected"] += 1
                        bad.write(json.dumps({"id": c.row_id, "reason": c.error}) + "\n")
                    else:
                        row = {"id": c.row_id, "key": c.key, "messages": c.outs}
                        out.write(json.dumps(row if c.tools is None else {**row, "tools": c.tools}) + "\n")
                        summary["rows"] += 1
                for f in (out, bad):
                    f.flush()
                    os.fsync(f.fileno())
                if summary["interrupted"]:
                    break
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


def generation_settings(target_model, args, server_model=None):
    """What defines a regeneration's answers, as settings_record keeps it."""
    return {"target_model": target_model, "server_model": server_model,
            "chat_template_kwargs": args.chat_template_kwargs, "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature, "top_p": args.top_p, "seed": args.seed,
            "max_context_tokens": getattr(args, "max_context_tokens", None)}


def regenerated_builtin_data(settings, log):
    """Every built-in conversation worth regenerating (builtin:sharegpt-prompts) with its
    assistant turns written by the built-in target (the GPU demo's training data): greedy, with
    the run's chat-template options, each conversation ending where its history reaches
    --max-length; cached (and resumed where a previous run stopped)."""
    key = hashlib.sha256(json.dumps([settings.chat_template_kwargs, settings.regen_max_new_tokens, settings.max_length])
                         .encode()).hexdigest()[:8]
    out = os.path.join(demo_assets.CACHE, "data", f"sharegpt_prompts.regen-smollm2-{key}.jsonl")
    done = out + ".done"
    if os.path.exists(done):
        return out
    log(f"demo: regenerating the built-in conversations with the target (once; cached at {out})")
    regen_args = argparse.Namespace(chat_template_kwargs=settings.chat_template_kwargs,
                                    max_new_tokens=settings.regen_max_new_tokens, batch_size=settings.regen_batch_size,
                                    temperature=0.0, top_p=1.0, seed=settings.seed,
                                    max_context_tokens=settings.max_length, decode_attention=settings.regen_attention)
    tokenizer = load_tokenizer(settings.target_model)
    gpus = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]  # one replica each
    summary = regenerate(demo_assets.builtin_prompts_file(), out, lambda progress: EmbeddedBackend(
        settings.target_model, gpus, tokenizer, regen_args, progress), generation_settings(settings.target_model,
                                                                                       regen_args),
        log=log, desc="demo: regenerating")
    log(f"demo: {summary['text']}")
    torch.cuda.empty_cache()  # the regenerating replica is gone: its cached blocks go too
    for d in gpus:  # the training log's peak memory is training's, not the regeneration's
        torch.cuda.reset_peak_memory_stats(d)
    open(done, "w").close()
    return out
