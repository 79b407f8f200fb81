"""Rewrite the assistant turns of a conversation JSONL with the target's own responses.

    python scripts/regenerate_data.py --target-model Qwen/Qwen3-8B --input sharegpt.jsonl \
        --output regen.jsonl --gpus 0,1,2,3,4,5,6,7 --max-new-tokens 2048 \
        --chat-template-kwargs '{"enable_thinking": false}'
    # or through a server that already serves the target (vllm serve, SGLang, llama.cpp):
    python scripts/regenerate_data.py --server http://localhost:8000/v1 --target-model Qwen/Qwen3-8B ...

DFlash drafters learn best from text the target itself would write, in the mode it will be served
in (thinking on or off: --chat-template-kwargs, the same as for training and serving). The
default is the target's greedy reply. For each conversation the user (and system) turns are kept
and every assistant turn is generated given the conversation so far, its earlier turns already
regenerated, batched over conversations (the embedded engine: static shapes, prompts batched by
length, one replica per GPU). Output rows are in the `messages` form the pipeline reads, with
`id` = the input line number and `key` = a hash of its prompt turns. Resumable: a rerun skips rows
already in --output (same line, same prompts; an --output written from another input is refused);
a conversation is written once its last turn is done, so a kill loses only the conversations in
progress, and Ctrl-C stops after the round under way (exit 130; rerun to resume). Rows that
fail (server errors after the retries) go to <output>.rejects.jsonl with the reason, and the exit
status is 1; a conversation whose first prompt is longer than the context limit is a counted skip.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dflash_train import chat_data  # noqa: E402
from dflash_train import demo_assets  # noqa: E402
from dflash_train import regeneration  # noqa: E402
from dflash_train import target_model  # noqa: E402
from dflash_train import command_line as cli  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target-model", required=True, help="the target (its tokenizer and chat template come with it)")
    p.add_argument("--input", required=True, help="JSONL: messages or conversations; or builtin:sharegpt-prompts "
                   "(every built-in ShareGPT conversation worth regenerating) or builtin:sharegpt")
    p.add_argument("--output", required=True)
    p.add_argument("--chat-template-kwargs", default=None, help="JSON, e.g. '{\"enable_thinking\": false}'")
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default suits DFlash training)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window", type=int, default=4096,
                   help="conversations in progress together: each round asks the next turn of each, and one that "
                   "is done is written and replaced from the input")
    g = p.add_argument_group("embedded engine (default)")
    g.add_argument("--gpus", default=None, help="e.g. 0,1,2,3 (one replica each); default: all visible, or cpu")
    g.add_argument("--batch-size", type=int, default=128, help="rows decoded together per replica")
    g.add_argument("--decode-attention", "--attention", dest="decode_attention", choices=["grouped", "flex"],
                   default="grouped",
                   help="the decode steps' attention: grouped SDPA over every cache slot, or flex_attention reading "
                   "only the slots each row uses, rows of any length sharing one decoder. On one H200 with every row "
                   "live: at SmolLM2's 9 query heads over 3 its step is 2.3x grouped's; where query heads per KV head "
                   "are a power of two (Qwen3-8B's 32 over 8) it gets inductor's decoding kernel and is 1.08-1.26x "
                   "faster (the decode step alone; not measured end to end)")
    g.add_argument("--max-context-tokens", type=int, default=0,
                   help="a conversation ends before a turn whose prompt has this many tokens (pass training's "
                   "--max-length: later turns are cut off there anyway); 0: the target's window less --max-new-tokens")
    g = p.add_argument_group("server backend")
    g.add_argument("--server", default=None, help="base URL of an OpenAI-compatible server, e.g. http://host:8000/v1")
    g.add_argument("--server-model", default=None, help="the model name the server knows (default: --target-model)")
    g.add_argument("--concurrency", type=int, default=32)
    g.add_argument("--timeout", type=float, default=600, help="seconds per request")
    g.add_argument("--retries", type=int, default=4)
    g.add_argument("--backoff", type=float, default=1.0, help="seconds before the first retry, doubling")
    args = p.parse_args(argv)
    for name in ("batch_size", "max_new_tokens", "window", "concurrency"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least 1")
    try:
        args.chat_template_kwargs = chat_data.parse_chat_template_kwargs(args.chat_template_kwargs)
    except chat_data.UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.server_model = args.server_model or args.target_model
    if args.server:
        make_backend = lambda progress: regeneration.ServerBackend(args.server, args, progress)  # noqa: E731
    else:
        devices = cli.parse_devices(args.gpus) if args.gpus else (
            [torch.device("cuda", i) for i in range(torch.cuda.device_count())] or [torch.device("cpu")])
        tokenizer = target_model.load_tokenizer(args.target_model)
        make_backend = lambda progress: regeneration.EmbeddedBackend(  # noqa: E731
            args.target_model, devices, tokenizer, args, progress)
    try:
        settings = regeneration.generation_settings(args.target_model, args, args.server_model if args.server else None)
        summary = regeneration.regenerate(demo_assets.builtin_data(args.input), args.output, make_backend, settings,
                                          args.window)
    except ValueError as e:  # an output written from another input, or with other settings
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary["text"])
    if summary["interrupted"]:
        print("interrupted: rerun the same command to resume", file=sys.stderr)
        return 130
    if summary["rejected"]:
        print(f"error: {summary['rejected']} conversations failed; their reasons are in {summary['rejects']}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
