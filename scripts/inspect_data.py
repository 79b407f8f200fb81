"""What the pipeline will train on: per-file counts, skips by reason, and examples with the trained span marked.

    python scripts/inspect_data.py --tokenizer Qwen/Qwen3-8B --data data/regen.jsonl --max-length 3072 \
        --chat-template-kwargs '{"enable_thinking": false}' --show 3 --dump docs.jsonl

Per file: rows, documents, assistant turns (and how many are trained), assistant tokens, tokens
with loss and their share, skipped rows and turns by reason, truncations by reason. --show K
prints K documents with the tokens that carry loss marked (green on a terminal, [[...]]
otherwise); --dump writes every document as {"input_ids": [...], "loss_mask": [...]}, exactly as
the pipeline trains on it before packing (the same tokenisation code: train_dflash_pipeline's
data stage).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_dflash_pipeline as tp  # noqa: E402


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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", required=True, help="tokenizer directory or id (the target model's)")
    p.add_argument("--data", nargs="+", required=True, help="JSONL files or globs")
    p.add_argument("--max-length", type=int, default=3072)
    p.add_argument("--chat-template-kwargs", default=None, help="JSON, as given to the pipeline")
    p.add_argument("--vocab-size", type=int, default=None, help="default: the tokenizer's size")
    p.add_argument("--dump", default=None, help="write every document here as JSONL")
    p.add_argument("--show", type=int, default=0, help="print this many documents with the trained span marked")
    args = p.parse_args(argv)
    try:
        kwargs = tp.parse_chat_template_kwargs(args.chat_template_kwargs)
        paths = tp.resolve_data_paths(args.data)
    except tp.UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tokenizer = tp.load_tokenizer(args.tokenizer)
    vocab = args.vocab_size or len(tokenizer)
    colour = sys.stdout.isatty()
    dump = open(args.dump, "w") if args.dump else None
    total, shown = tp.DocumentStats(), 0
    for path in paths:
        docs, stats = tp.read_documents(path, tokenizer, args.max_length, vocab, kwargs)
        total.add(stats)
        print(f"{path}:")
        for line in stats.summary():
            print(f"  {line}")
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
    if dump:
        dump.close()
        print(f"documents written to {args.dump}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
