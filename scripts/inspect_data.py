"""What the pipeline will train on: per-file counts, skips by reason, and examples with the trained span marked.

    python scripts/inspect_data.py --tokenizer Qwen/Qwen3-8B --data data/regen.jsonl --max-length 3072 \
        --chat-template-kwargs '{"enable_thinking": false}' --show 3 --dump docs.jsonl

Per file: rows, documents, assistant turns (and how many are trained), assistant tokens, tokens
with loss and their share, skipped rows and turns by reason, truncations by reason. --show K
prints K documents with the tokens that carry loss marked (green on a terminal, [[...]]
otherwise); --dump writes every document as {"input_ids": [...], "loss_mask": [...]}, exactly as
the pipeline trains on it before packing (the same tokenisation code: train_dflash_pipeline's
data stage). --lookup replays prompt-lookup decoding (the evaluator's: n-gram up to 3, block
16, greedy) over every trained span, given the document before it: how much of the data a
model could copy from its own context, for the first span of each document and the later ones
(target-written data that loops shows here as high figures and many whole blocks).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np  # noqa: E402

from dflash_train import chat_data  # noqa: E402
from dflash_train import decoding  # noqa: E402
from dflash_train import evaluation  # noqa: E402
from dflash_train import target_model  # noqa: E402


def marked(tokenizer, ids, mask, colour):
    """The document's text with each run of loss-carrying tokens marked."""
    out, run, on = [], [], None
    for t, m in list(zip(ids, mask)) + [(None, None)]:
        if m != on and run:
            text = tokenizer.decode(run)
            out.append((f"\033[42;30m{text}\033[0m" if colour else f"[[{text}]]") if on else text)
            run = []
        if t is not None:
            run.append(t)
            on = m
    return "".join(out)


LOOKUP_BLOCK = 16  # the evaluator's block size for prompt lookup: the drafter's


def lookup_gains(ids, mask):
    """Prompt lookup replayed over each trained span of a document (each run of loss tokens,
    given all the document before it): a list of gains lists, one per span in order."""
    ids = np.asarray(ids)
    lookup = lambda p, end: decoding.lookup_accepted(ids, p, end, LOOKUP_BLOCK)  # noqa: E731
    return [gains for gains, _ in evaluation.replayed_over_answers(lookup, mask, np.zeros(len(ids)))]


def lookup_summary(spans):
    """'acceptance A (first spans F, later L); W% of the tokens in whole blocks' over gains lists
    [(is first span, gains)]."""
    first = [g for is_first, gains in spans if is_first for g in gains]
    later = [g for is_first, gains in spans if not is_first for g in gains]
    every = first + later
    mean = lambda gs: f"{sum(gs) / len(gs):.2f}" if gs else "-"  # noqa: E731
    whole = sum(g for g in every if g == LOOKUP_BLOCK)
    return (f"prompt lookup replayed over the trained spans: acceptance {mean(every)} (first span of a document "
            f"{mean(first)}, later spans {mean(later)}); {whole / max(sum(every), 1):.1%} of the tokens in whole "
            "blocks")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", required=True, help="tokenizer directory or id (the target model's)")
    p.add_argument("--data", nargs="+", required=True,
                   help="data files or globs, as the pipeline's --data (JSONL, JSON array, Parquet, a saved data set)")
    p.add_argument("--data-fields", default=None, help="as the pipeline's, e.g. 'messages=conversation'")
    p.add_argument("--max-length", type=int, default=3072)
    p.add_argument("--chat-template-kwargs", default=None, help="JSON, as given to the pipeline")
    p.add_argument("--vocab-size", type=int, default=None, help="default: the tokenizer's size")
    p.add_argument("--dump", default=None, help="write every document here as JSONL")
    p.add_argument("--show", type=int, default=0, help="print this many documents with the trained span marked")
    p.add_argument("--lookup", action="store_true", help="prompt lookup replayed over the trained spans (see above)")
    args = p.parse_args(argv)
    try:
        kwargs = chat_data.parse_chat_template_kwargs(args.chat_template_kwargs)
        fields = chat_data.parse_data_fields(args.data_fields)
        paths = chat_data.resolve_data_paths(args.data)
    except chat_data.UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tokenizer = target_model.load_tokenizer(args.tokenizer)
    vocab = args.vocab_size or len(tokenizer)
    colour = sys.stdout.isatty()
    dump = open(args.dump, "w") if args.dump else None
    total, shown, all_spans = chat_data.DocumentStats(), 0, []
    for path in paths:
        docs, stats = chat_data.read_documents(path, tokenizer, args.max_length, vocab, kwargs, workers=0,
                                               fields=fields)
        total.add(stats)
        print(f"{path}:")
        for line in stats.summary():
            print(f"  {line}")
        if args.lookup:  # minutes for millions of tokens: a progress bar
            from tqdm import tqdm
            spans = [(k == 0, g) for ids, mask in tqdm(docs, desc="prompt lookup", unit="doc", leave=False)
                     for k, g in enumerate(lookup_gains(ids, mask))]
            all_spans += spans
            print(f"  {lookup_summary(spans)}")
        for ids, mask in docs:
            if dump:
                dump.write(json.dumps({"input_ids": [int(t) for t in ids], "loss_mask": [int(m) for m in mask]}) + "\n")
            if shown < args.show:
                shown += 1
                print(f"\n--- document {shown} ({len(ids)} tokens, {sum(mask)} with loss) ---")
                print(marked(tokenizer, ids, mask, colour))
                print("---\n")
    if len(paths) > 1:
        print("all files:")
        for line in total.summary():
            print(f"  {line}")
        if args.lookup:
            print(f"  {lookup_summary(all_spans)}")
    if dump:
        dump.close()
        print(f"documents written to {args.dump}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
