"""The acceptance length, measured by real, lossless speculative decoding against the target.

The same prompts, batched, three ways: plain greedy decoding (the reference and the time to
beat), speculative decoding with the drafter, and with prompt lookup (n-gram drafting: the free
baseline). Every speculative output is checked against the greedy one. Multi-turn prompts
continue with the greedy answer, so every method sees the same history. Used at the end of a
run, by --eval-interval and by scripts/eval_acceptance.py. Also the teacher-forced figures
(tau at every position, decoding replayed over known answers) that training's validation logs.
"""

import hashlib
import json
import os
import time
from collections import Counter, defaultdict

import numpy as np
import torch

import dflash_model as dm
from dflash_train.chat_data import BadRow, DocumentStats, jsonl_rows, prompt_ids, row_to_messages
from dflash_train.decoding import check_batchable, generate, lookup_accepted, speculative_generate
from dflash_train.demo_assets import BUILTIN_MODEL, mtbench_file
from dflash_train.target_model import collect_layer_outputs, load_full_target, load_tokenizer, stop_token_ids
from dflash_train import helpers

def prompt_turns(row):
    """The user turns of one prompts-file row: text, or token ids (input_ids: one turn, the prompt
    exactly as the target reads it); a messages row's system prompt first, as a system message.
    Rows of the usual acceptance benchmarks read too: question, problem, instruction (+ input),
    text. BadRow, naming the reason, for a row that is none of these."""
    if not isinstance(row, dict):
        raise BadRow("not a JSON object")
    is_text = lambda t: isinstance(t, str) and t.strip() != ""
    if "input_ids" in row:
        ids = row["input_ids"]
        if not (isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
            raise BadRow("input_ids is not a list of token ids")
        return [ids]
    if "turns" in row:
        if not (isinstance(row["turns"], list) and row["turns"] and all(map(is_text, row["turns"]))):
            raise BadRow("turns is not a non-empty list of text")
        return list(row["turns"])
    if "prompt" in row:
        if not is_text(row["prompt"]):
            raise BadRow("prompt is not text")
        return [row["prompt"]]
    if "messages" in row or "conversations" in row:
        messages = row_to_messages(row, require_assistant=False)
        turns = [m["content"] for m in messages if m["role"] == "user"]
        if not turns or not all(map(is_text, turns)):
            raise BadRow("no user turn with text")
        first_user = next(k for k, m in enumerate(messages) if m["role"] == "user")
        system = [{"role": "system", "content": m["content"]} for m in messages[:first_user] if m["role"] == "system"]
        return system + turns
    for field in ("question", "problem", "text"):
        if field in row:
            if not is_text(row[field]):
                raise BadRow(f"{field} is not text")
            return [row[field]]
    if "instruction" in row:
        extra = row.get("input") or ""
        if not is_text(row["instruction"]) or not isinstance(extra, str):
            raise BadRow("instruction (or its input) is not text")
        return [row["instruction"] + ("\n\n" + extra if extra.strip() else "")]
    raise BadRow("no prompt, turns, messages, conversations, input_ids, question, problem, instruction or text")


def split_system(turns):
    """(the prompt's system messages, its user turns) of a prompt's turns (prompt_turns)."""
    return [t for t in turns if isinstance(t, dict)], [t for t in turns if not isinstance(t, dict)]


def first_turns(turns, n):
    """A prompt's system messages and its first n user turns."""
    system, user = split_system(turns)
    return system + user[:n]


def read_prompts(path, log=print):
    """[(category, [user turn, ...]), ...] from a JSONL prompts file (prompt_turns; the category
    defaults to the file's name). Rows that cannot be used (bad JSON, not UTF-8, a field of the
    wrong type, no turn) are skipped, counted by reason with file:line examples, and said; a file
    with no usable row is an error."""
    out, stats = [], DocumentStats()
    default = os.path.splitext(os.path.basename(path))[0]
    for _, where, row in jsonl_rows(path, stats):
        try:
            out.append((str(row.get("category", default)), prompt_turns(row)))
        except BadRow as e:
            stats.note(stats.skipped_rows, str(e), where)
    for line in stats.summary()[1:]:
        log(f"prompts: {line.strip()}")
    if not out:
        raise ValueError(f"{path}: no usable prompt ({stats.counts['rows']} rows; {stats.skipped_rows})")
    return out


def file_digest(path):
    """sha256 of a file's bytes: which prompts a report measured."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def has_heldout_prompts(settings):
    """Whether a run has held-out prompts to evaluate on (heldout_prompts_file, nothing fetched)."""
    return bool(getattr(settings, "eval_data", None)) or settings.target_model == BUILTIN_MODEL


def heldout_prompts_file(settings):
    """--eval-data, else MT-Bench for the built-in target (never in its built-in training data,
    whichever of them it trains on), else None."""
    if not has_heldout_prompts(settings):
        return None
    return settings.eval_data or mtbench_file()


def heldout_prompts(settings, tokenizer, n):
    """Prompts the pipeline's evaluations use: n of heldout_prompts_file's, spread over it."""
    path = heldout_prompts_file(settings)
    if path is None:
        return []
    prompts = read_prompts(path)
    if n <= 0:
        return []
    step = max(1, len(prompts) // n)
    return [(cat, first_turns(turns, getattr(settings, "eval_turns", 1))) for cat, turns in prompts[::step][:n]]


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


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
    with collect_layer_outputs(target, drafter.target_layer_ids) as hidden:
        target(ids)
    taus = drafter.accepted_lengths(torch.cat(hidden, -1).to(drafter.fc.weight.dtype), ids,
                                    torch.arange(P, L - 1, device=ids.device)[None])[0].tolist()
    return taus, replayed_gains(lambda i: taus[i], L - P)


@torch.no_grad()
def accepted_lengths_everywhere(drafter, target_hidden, input_ids, loss_mask, doc_ids, position_ids, num_anchors,
                                ce_chunk_size=4096, attention="sdpa", distribution=None):
    """The teacher-forced gain at every position of a batch [B, L], num_anchors blocks a row at a
    time: greedy's, or with distribution (the target's top ids and probabilities at a temperature
    [B, L, k]) the expected gain of speculative sampling (expected_accepted_lengths)."""
    L = input_ids.shape[1]
    taus = []
    for start in range(0, L, num_anchors):
        anchors = torch.arange(start, start + num_anchors, device=input_ids.device).clamp(max=L - 1)
        anchors = anchors.repeat(input_ids.shape[0], 1)
        if distribution is None:
            taus.append(drafter.accepted_lengths(target_hidden, input_ids, anchors, loss_mask, doc_ids, position_ids,
                                                 ce_chunk_size, attention))
        else:
            taus.append(drafter.expected_accepted_lengths(target_hidden, input_ids, anchors, distribution, loss_mask,
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


def slot_acceptance(gains, block_size):
    """The acceptance rate of each draft slot k = 1.. given the slots before it were accepted:
    steps that accepted k drafts or more over those that accepted k - 1 or more."""
    accepted = [g - 1 for g in gains]
    reached = [sum(m >= k for m in accepted) for k in range(block_size)]
    return [round(reached[k] / reached[k - 1], 4) if reached[k - 1] else None for k in range(1, block_size)]


METHODS = ("greedy", "drafter", "lookup")  # the target alone, with the drafter, with prompt lookup


def speedups(seconds, acceptance, lookup_acceptance):
    """Each speculative method's speed-up over the target alone, from the seconds each took on
    the same answers. Speculative decoding yields at most its acceptance length in tokens a target
    forward, and a forward over a block costs no less than over one token, so a speed-up above the
    acceptance length is a timing error (contention, a cost one method paid alone): it is None
    then, and timing_error says what was measured."""
    out, errors = {}, []
    for key, name, bound in (("speedup_vs_greedy", "drafter", acceptance),
                             ("prompt_lookup_speedup_vs_greedy", "lookup", lookup_acceptance)):
        speed = seconds["greedy"] / max(seconds[name], 1e-9)
        out[key] = speed if speed <= bound else None
        if speed > bound:
            errors.append(f"{name} {speed:.2f}x over greedy exceeds its acceptance length {bound:.2f}")
    return {**out, "timing_error": "; ".join(errors) or None}


def speedup_text(report):
    """The speed-ups of a report as a log line says them, or why they were not measured."""
    if report["timing_error"]:
        return f"speed-up over greedy not measured ({report['timing_error']}: a timing error)"
    return (f"speed-up over greedy {report['speedup_vs_greedy']:.2f}x (prompt lookup "
            f"{report['prompt_lookup_speedup_vs_greedy']:.2f}x)")


def evaluate_models(target, tokenizer, drafter, prompts, device, max_new_tokens, log=print,
                    chat_template_kwargs=None, batch_size=64, show_progress=True, temperature=0.0, top_p=1.0,
                    seed=0, files=None):
    """Target, drafter and prompt-lookup decoding of every prompt (turn by turn); returns the
    report dict: both acceptance lengths, per category, as histograms and per draft slot, the
    speed-up of both over the target alone in the same run, and (greedy) whether every output
    equals the greedy one. At a temperature every decoding samples (seeded; speculative
    sampling's output is distributed as the target's), multi-turn prompts continue with the
    target's own sample, and outputs are not compared token for token (lossless: None). files:
    each prompt's file, for the per-file figures."""
    from tqdm import tqdm
    try:
        check_batchable(target.config)
    except ValueError as e:
        log(f"eval: {e}; the model's own forward decodes every step instead (exact, slower)")
    stop = stop_token_ids(tokenizer, target.generation_config)
    gains = {"drafter": defaultdict(list), "lookup": defaultdict(list)}
    by_file = {"drafter": defaultdict(list), "lookup": defaultdict(list)}
    seconds = {"greedy": 0.0, "drafter": 0.0, "lookup": 0.0}
    histories = [split_system(turns)[0] for _, turns in prompts]  # a system prompt stays the conversation's
    prompts = [(category, split_system(turns)[1]) for category, turns in prompts]
    mismatches = []
    generated = forwards = 0
    tf_taus, tf_gains, lookup_taus = [], [], []
    per_answer = []  # the target's own tokens and the drafter's gain at each verification step, per answer
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
        def decode(name, new_tokens, progress=None):
            if name == "greedy":
                return [(t, None) for t, _ in generate(target, ids, new_tokens, stop, batch_size, temperature, top_p,
                                                       seed + k, progress=progress)]
            kw = {"drafter": drafter} if name == "drafter" else {"drafter": None, "block_size": drafter.block_size}
            return speculative_generate(target, ids, new_tokens, stop, batch_size=batch_size, progress=progress,
                                        temperature=temperature, top_p=top_p, seed=seed + k, **kw)
        if k == 0:  # untimed: every first call's costs (allocations, compiled kernels) are not any method's
            for name in METHODS:
                decode(name, min(max_new_tokens, 16))
        runs = {}
        for name in METHODS[k % 3:] + METHODS[:k % 3]:  # each method first in turn, none always after another
            bar.set_postfix_str(f"turn {k + 1}: {name}")
            sync(device)
            t0 = time.perf_counter()
            runs[name] = decode(name, max_new_tokens, progress=lambda rows, tokens: bar.update(rows))
            sync(device)
            seconds[name] += time.perf_counter() - t0
        for j, i in enumerate(live):
            category, reference = prompts[i][0], runs["greedy"][j][0]
            for name in ("drafter", "lookup"):
                output, gained = runs[name][j]
                if output != reference and temperature <= 0:
                    first = next((n for n, (a, b) in enumerate(zip(output, reference)) if a != b),
                                 min(len(output), len(reference)))
                    tie, gap = near_tie(target, ids[j], reference, output, first) \
                        if first < min(len(output), len(reference)) else (False, None)
                    mismatches.append({"method": name, "prompt": i, "turn": k, "first_difference_at": first,
                                       "near_tie": tie, "logit_gap": gap})
                gains[name][category] += gained
                if name == "drafter":
                    per_answer.append({"prompt": i, "turn": k, "target_tokens": list(reference),
                                       "gains": list(gained)})
                if files is not None:
                    by_file[name][files[i]] += gained
            taus, replayed = teacher_forced_gains(target, drafter, torch.tensor([ids[j]], device=device), reference)
            tf_taus += taus
            tf_gains += replayed
            seq = np.asarray(list(ids[j]) + list(reference))
            lookup_taus += [lookup_accepted(seq, len(ids[j]) + n, len(seq), drafter.block_size)
                            for n in range(len(taus))]
            generated += len(reference)
            forwards += 1 + len(runs["drafter"][j][1])  # prefill + one verification per block
            if not isinstance(prompts[i][1][k], list):
                answer = tokenizer.decode(reference, skip_special_tokens=True)
                histories[i].append({"role": "assistant", "content": answer})
    bar.close()
    copies = where_lookup_copies(tf_taus, lookup_taus, drafter.block_size)
    acceptance, per_category, histogram = acceptance_summary(gains["drafter"])
    lookup, lookup_per_category, lookup_histogram = acceptance_summary(gains["lookup"])
    report = {
        "acceptance_length": acceptance, "per_category": per_category, "histogram": histogram,
        "prompt_lookup_acceptance_length": lookup, "prompt_lookup_per_category": lookup_per_category,
        "prompt_lookup_histogram": lookup_histogram,
        "acceptance_per_slot": slot_acceptance([g for v in gains["drafter"].values() for g in v], drafter.block_size),
        "prompt_lookup_acceptance_per_slot": slot_acceptance([g for v in gains["lookup"].values() for g in v],
                                                             drafter.block_size),
        "temperature": temperature, "top_p": top_p, "seed": seed,
        "per_file": {f: {"acceptance_length": acceptance_summary({f: g})[0],
                         "prompt_lookup_acceptance_length": acceptance_summary({f: by_file["lookup"][f]})[0]}
                     for f, g in by_file["drafter"].items()},
        "tokens_per_target_forward": generated / max(forwards, 1),
        # the drafter teacher-forced on the greedy answers: tau_hat as training computes it, and
        # real decoding replayed over its taus (= acceptance_length but for the answers' last blocks)
        "teacher_forced_tau_hat": sum(tf_taus) / max(len(tf_taus), 1),
        "teacher_forced_acceptance_length": sum(tf_gains) / max(len(tf_gains), 1),
        **copies,
        **speedups(seconds, acceptance, lookup),
        "greedy_s": seconds["greedy"], "speculative_s": seconds["drafter"], "prompt_lookup_s": seconds["lookup"],
        "prompts": len(prompts), "answers": sum(len(t) for _, t in prompts), "generated_tokens": generated,
        "max_new_tokens": max_new_tokens, "block_size": drafter.block_size, "batch_size": batch_size,
        # a difference at a near-tie of the target's own logits is rounding, not a wrong token
        "lossless": not [m for m in mismatches if not m["near_tie"]] if temperature <= 0 else None,
        "mismatches": mismatches,
        "near_ties": sum(m["near_tie"] for m in mismatches),
        "per_answer": per_answer,
    }
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    log(f"eval{f' at temperature {temperature:g}' if temperature > 0 else ''}: acceptance length {acceptance:.2f} "
        f"(prompt lookup {lookup:.2f}) on {report['answers']} answers; per slot {report['acceptance_per_slot']}; "
        f"histogram {histogram}; teacher-forced on the target's own outputs: tau_hat "
        f"{report['teacher_forced_tau_hat']:.2f}, "
        f"decoding replayed {report['teacher_forced_acceptance_length']:.2f}; where prompt lookup copies "
        f"({copies['lookup_copies_share']:.0%} of the tokens; its tau {fmt(copies['lookup_tau_hat_where_it_copies'])}) "
        f"the drafter's tau_hat is {fmt(copies['teacher_forced_tau_hat_where_lookup_copies'])}, elsewhere "
        f"{fmt(copies['teacher_forced_tau_hat_elsewhere'])}; {speedup_text(report)} at batch {batch_size}; "
        f"lossless: {report['lossless']}" + (f" ({report['near_ties']} outputs part at a near-tie of the target's "
                                             "logits: rounding)" if report["near_ties"] else ""))
    return report


def drafter_target_mismatches(drafter_config, target_config):
    """What a drafter's config says of its target that this target is not: hidden size,
    vocabulary, layer count, target layers past its layers. An empty list if it fits."""
    tc = helpers.text_config(target_config)
    layers = tc.num_hidden_layers
    ids = list(drafter_config.dflash_config["target_layer_ids"])
    out = [f"{name} {getattr(drafter_config, name)} (the target: {getattr(tc, name)})"
           for name in ("hidden_size", "vocab_size") if getattr(drafter_config, name) != getattr(tc, name)]
    if getattr(drafter_config, "num_target_layers", layers) != layers:
        out.append(f"num_target_layers {drafter_config.num_target_layers} (the target: {layers})")
    if max(ids) >= layers:
        out.append(f"target_layer_ids {ids} (the target has {layers} layers)")
    return out


def evaluation_report_path(target_name, drafter_dir, output=None):
    """Where a report goes: --output where given; else beside the drafter, but only when the
    target is the drafter's own (its training record's), so a report against another target never
    takes the place of the drafter's own."""
    if output is not None:
        return output
    trained_for = dm.read_training_record(drafter_dir).get("target_model")
    if trained_for is not None and trained_for != target_name:
        raise ValueError(f"{drafter_dir} was trained for {trained_for}, not {target_name}: name the report's file "
                         "(--output) rather than replace the drafter's own eval_acceptance.json")
    return os.path.join(drafter_dir, "eval_acceptance.json")


def evaluate_drafter_dir(target_name, drafter_dir, prompts, device, max_new_tokens, chat_template_kwargs=None,
                         log=print, target=None, batch_size=64, prompt_files=(), output=None, temperature=0.0,
                         top_p=1.0, seed=0, files=None):
    """evaluate_models on a saved drafter directory (`target`: an already loaded target to reuse),
    after checking that the drafter fits the target (ValueError naming each difference, before
    anything decodes). The report says what it measured (target, drafter, prompt files and their
    hashes, decoding settings) and is written to evaluation_report_path()."""
    path = evaluation_report_path(target_name, drafter_dir, output)
    config = dm.DFlashDraftModel.read_config(drafter_dir)
    target = target if target is not None else load_full_target(target_name, device)
    wrong = drafter_target_mismatches(config, target.config)
    if wrong:
        raise ValueError(f"the drafter {drafter_dir} does not fit the target {target_name}: {'; '.join(wrong)}")
    tokenizer = load_tokenizer(target_name)
    dtype = next(target.parameters()).dtype
    drafter = dm.DFlashDraftModel.from_pretrained(drafter_dir, device=device, dtype=dtype).attach_target(target).eval()
    report = evaluate_models(target, tokenizer, drafter, prompts, device, max_new_tokens, log, chat_template_kwargs,
                             batch_size, files=files)
    if temperature > 0:  # the greedy report, and the sampled one beside it
        report["sampled"] = evaluate_models(target, tokenizer, drafter, prompts, device, max_new_tokens, log,
                                            chat_template_kwargs, batch_size, True, temperature, top_p, seed, files)
    report.update(target=target_name, drafter=os.path.abspath(drafter_dir),
                  prompt_files=[{"file": os.path.abspath(f), "sha256": file_digest(f)} for f in prompt_files],
                  decoding={"temperature": 0.0, "sampled_temperature": temperature, "top_p": top_p, "seed": seed,
                            "max_new_tokens": max_new_tokens, "batch_size": batch_size,
                            "chat_template_kwargs": chat_template_kwargs or {}})
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    return report
