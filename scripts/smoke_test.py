"""Run before every full run, with the same flags: a few real pipeline steps and a check of each stage.

    python scripts/smoke_test.py --target-model Qwen/Qwen3-8B --data data/*.jsonl \
        --target-gpus 0,1,2,3,4,5 --drafter-gpus 6,7 --compile --token-budget 12288

Checks, in order, and stops at the first failure with its reason (exit 1): data reads and
tokenises; the target loads (and runs one batch) on every target device; the drafter builds on
every drafter device; compilation and graph capture succeed on every worker (--compile); a few
steps run with finite, falling loss; memory after warm-up does not grow; a checkpoint saves and
loads back; tokens/s. Time-boxed (--time-limit): past it the process exits, threads and all.
Writes into a temporary directory, never into the run's --output-dir; a passing run deletes it
(a big target's drafter checkpoint is gigabytes), a failing or timed-out one keeps it and names it.
"""

import os
import shutil
import sys
import tempfile
import threading
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dflash_model as dm  # noqa: E402
import train_dflash_pipeline as tp  # noqa: E402

RESULTS = []
SCRATCH = None  # the run's output directory, made by main()


class CheckFailed(Exception):
    pass


def check(name, fn):
    t0 = time.perf_counter()
    print(f"[....] {name}", flush=True)
    try:
        detail = fn()
    except CheckFailed as e:
        detail = None
        reason = str(e)
    except tp.UsageError as e:
        detail = None
        reason = f"setting: {e}"
    except Exception:
        detail = None
        reason = traceback.format_exc()
    else:
        RESULTS.append((name, "ok", detail, time.perf_counter() - t0))
        print(f"[ ok ] {name}: {detail} ({time.perf_counter() - t0:.1f}s)", flush=True)
        return
    RESULTS.append((name, "FAILED", reason, time.perf_counter() - t0))
    print(f"[FAIL] {name}: {reason}", flush=True)
    stop(1)


def summary():
    print("\n" + "=" * 78)
    print("smoke test summary")
    for name, status, detail, dt in RESULTS:
        print(f"  {status:6s} {name:44s} {dt:7.1f}s  {str(detail).splitlines()[0][:60] if detail else ''}")
    print("=" * 78, flush=True)


def stop(exit_code):
    """Summary, then exit at once: os._exit also ends any thread a stage left behind."""
    summary()
    if exit_code == 0:
        shutil.rmtree(SCRATCH, ignore_errors=True)
        print("smoke test passed")
    else:
        print(f"scratch output kept for inspection in {SCRATCH}")
    sys.stdout.flush()
    os._exit(exit_code)


def main(argv=None):
    parser = tp.build_parser()
    parser.description = __doc__.split("\n")[0]
    parser.add_argument("--smoke-steps", type=int, default=20, help="training steps to run")
    parser.add_argument("--time-limit", type=float, default=1800, help="seconds before the smoke test gives up")
    args = tp.apply_demo_defaults(parser, parser.parse_args(argv), argv)
    global SCRATCH
    SCRATCH = args.output_dir = tempfile.mkdtemp(prefix="dflash_smoke_")

    def give_up():
        print(f"\n[FAIL] time limit: the smoke test did not finish within {args.time_limit:.0f}s", flush=True)
        stop(3)
    timer = threading.Timer(args.time_limit, give_up)
    timer.daemon = True
    timer.start()

    args.max_steps, args.eval_prompts = args.smoke_steps, 0
    args.log_interval = max(1, args.smoke_steps // 4)
    args.save_interval = args.smoke_steps
    s = {}

    def settings():
        s["targets"], s["drafters"], s["tc"] = tp.resolve_settings(args)
        s["log_file"], s["log"] = tp.open_log(args)
        return (f"target {[str(d) for d in s['targets']]}, drafter workers {[str(d) for d in s['drafters']]}, "
                f"budget {args.token_budget}, compile {args.compile}")
    check("settings and layout", settings)

    def data():
        s["tokenizer"] = tp.load_tokenizer(args.target_model)
        s["corpus"], s["batches"], _ = tp.prepare_data(args, s["tokenizer"], s["tc"].vocab_size, lambda m: None)
        args.mask_token_id = tp.choose_mask_token_id(s["tokenizer"], s["tc"].vocab_size, s["corpus"],
                                                     args.mask_token_id, args.target_model, args.chat_template_kwargs)
        return f"{s['corpus'].stats.summary()[0]}; packing {s['batches'].packing_efficiency:.1%}"
    check("data reads and tokenises", data)

    def target():
        s["replicas"], s["embed"], s["head"] = tp.load_target_replicas(args.target_model, s["targets"], args.layer_ids,
                                                                       s["log"], *tp.target_stage_options(args, s["targets"]))
        rows = args.token_budget // args.max_length
        for r in s["replicas"]:
            out = r.features(r.synthetic_batch(rows, args.max_length))
            if not torch.isfinite(out).all():
                raise CheckFailed(f"target on {r.device} produced non-finite features")
        return f"{len(s['replicas'])} replica(s) ran one {rows} x {args.max_length} batch"
    check("target loads on every target device", target)

    def drafter():
        s["models"] = tp.build_drafters(args, s["tc"], s["drafters"], s["embed"], s["head"], s["log"])
        return f"{s['models'][0].num_parameters() / 1e6:.1f}M parameters on {len(s['models'])} device(s)"
    check("drafter builds on every drafter device", drafter)

    def steps():
        total = args.max_steps
        settings = tp.run_settings(args, s["corpus"], tp.resolve_data_paths(args.data))
        plan = tp.plan_run(args, settings, s["batches"], len(s["drafters"]), None, s["log"])
        run = tp.Run(args, plan, s["batches"], s["targets"] + s["drafters"], s["log_file"])
        tp.run_pipeline(run, s["replicas"], s["models"], s["drafters"], show_progress=False)
        s["run"] = run
        if run.errors:
            raise CheckFailed("\n".join(f"{where}:\n{tb}" for where, tb in run.errors))
        if args.compile and not all(w.graphs for w in run.workers):
            raise CheckFailed("a worker ran without its CUDA graph")
        return f"{total} steps" + (", every worker compiled and captured its step" if args.compile else "")
    check("compile + capture on every worker, steps run" if args.compile else "steps run", steps)

    def metrics():
        import json
        with open(os.path.join(args.output_dir, "metrics.jsonl")) as f:
            s["metrics"] = [json.loads(line) for line in f]
        return s["metrics"]

    def loss():
        m = metrics()
        losses = [x["loss"] for x in m]
        if not all(map(lambda v: v == v and abs(v) != float("inf"), losses)):
            raise CheckFailed(f"non-finite loss: {losses}")
        if not losses[-1] < losses[0]:
            raise CheckFailed(f"loss did not fall: {losses}")
        return " -> ".join(f"{v:.3f}" for v in losses)
    check("loss finite and falling", loss)

    def memory():
        m = s["metrics"]
        if not m[0]["peak_mem_gb"]:
            return "no GPU (not measured on CPU)"
        first, last = m[1 if len(m) > 2 else 0]["peak_mem_gb"], m[-1]["peak_mem_gb"]
        grown = {d: (first[d], last[d]) for d in last if last[d] > first[d] * 1.01 + 0.01}
        if grown:
            raise CheckFailed(f"peak memory grew after warm-up (GB, first -> last): {grown}")
        return f"peak GB {last}"
    check("memory after warm-up does not grow", memory)

    def checkpoint():
        found = tp.find_checkpoint("auto", args.output_dir, s["log"])
        if found is None:
            raise CheckFailed("no checkpoint was written")
        ckpt = found[0]
        worker = s["run"].workers[0]
        loaded = dm.DFlashDraftModel.from_pretrained(ckpt, device=worker.device)
        for (n, p), q in zip(worker.drafter.named_parameters(), loaded.parameters()):
            if not torch.equal(p.detach(), q):
                raise CheckFailed(f"{ckpt}: {n} differs from the trained drafter")
        return f"{ckpt} loads with from_pretrained, weights equal"
    check("checkpoint saves and loads back", checkpoint)

    def throughput():
        last = s["metrics"][-1]
        return (f"{last['tokens_per_s']:,.0f} tokens/s (real {last['real_tokens_per_s']:,.0f}), "
                f"{last['drafter_steps_per_s']:.2f} drafter steps/s, queues {last['queue_depths']}")
    check("tokens/s", throughput)
    stop(0)


if __name__ == "__main__":
    main()
