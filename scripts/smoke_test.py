"""Run before every full run, with the same flags: a few real pipeline steps and a check of each stage.

    python scripts/smoke_test.py --target-model Qwen/Qwen3-8B --data data/*.jsonl \
        --target-gpus 0,1,2,3,4,5 --drafter-gpus 6,7 --compile --token-budget 12288

Checks, in order, and stops at the first failure with its reason (exit 1): data reads and
tokenises; the target loads (and runs one batch) on every target device and the drafter builds
on every drafter device; the target stage's features of a packed row equal the transformers
forward of each of its documents alone, layer by layer; compilation and graph capture succeed
on every worker (--compile); a few steps run with finite, falling loss; memory after warm-up
does not grow; a checkpoint saves and loads back; tokens/s. Time-boxed (--time-limit): past it
the process exits, threads and all. Each check runs the trainer's own stage
(train_dflash_pipeline.Trainer: load_data, load_models, train, finish) with the run's flags, for
--smoke-steps steps and no evaluation.
Writes into a temporary directory, never into the run's --output-dir; a passing run deletes it
(a big target's drafter checkpoint is gigabytes), a failing or timed-out one keeps it and names it.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dflash_train import chat_data  # noqa: E402
import dflash_model as dm  # noqa: E402
import train_dflash_pipeline as tp  # noqa: E402
from dflash_train import checkpoints as ck  # noqa: E402
from dflash_train import command_line as cli  # noqa: E402

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
    except chat_data.UsageError as e:
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
    parser = cli.build_parser()
    parser.description = __doc__.split("\n")[0]
    parser.add_argument("--smoke-steps", type=int, default=20, help="training steps to run")
    parser.add_argument("--time-limit", type=float, default=1800, help="seconds before the smoke test gives up")
    flags = cli.parse_flags(argv, parser)
    global SCRATCH
    SCRATCH = tempfile.mkdtemp(prefix="dflash_smoke_")

    def give_up():
        print(f"\n[FAIL] time limit: the smoke test did not finish within {flags.time_limit:.0f}s", flush=True)
        stop(3)
    timer = threading.Timer(flags.time_limit, give_up)
    timer.daemon = True
    timer.start()

    # The run's own flags, but a short run into the scratch directory, with no final evaluation.
    smoke = dict(output_dir=SCRATCH, max_steps=flags.smoke_steps, eval_prompts=0, eval_interval=0,
                 log_interval=max(1, flags.smoke_steps // 4), save_interval=flags.smoke_steps, resume=None)
    run_flags = {k: v for k, v in vars(flags).items() if k not in ("smoke_steps", "time_limit")}
    t = {}  # the Trainer, once its settings resolve

    def settings():
        t["trainer"] = tp.Trainer(cli.resolve_settings(argparse.Namespace(**{**run_flags, **smoke})))
        s = t["trainer"].settings
        return (f"target {[str(d) for d in s.target_devices]}, drafter workers {[str(d) for d in s.drafter_devices]}, "
                f"budget {s.token_budget}, compile {s.compile}")
    check("settings and layout", settings)
    trainer = t["trainer"]

    def data():
        trainer.load_data()
        return f"{trainer.data.corpus.stats.summary()[0]}; packing {trainer.data.batches.packing_efficiency:.1%}"
    check("data reads and tokenises", data)

    def models():
        trainer.load_models()
        s = trainer.settings
        for r in trainer.replicas:
            out = r.target_hidden(r.synthetic_batch(s.rows_per_batch, s.max_length))
            if not torch.isfinite(out).all():
                raise CheckFailed(f"target on {r.device} produced non-finite hidden states")
        return (f"{len(trainer.replicas)} target replica(s) ran one {s.rows_per_batch} x {s.max_length} batch; "
                f"drafter {trainer.drafters[0].num_parameters() / 1e6:.1f}M parameters on {len(trainer.drafters)} "
                "device(s)")
    check("target and drafter load on every device", models)

    def same_as_transformers():
        try:
            errors = trainer.check_target()
        except chat_data.UsageError as e:
            raise CheckFailed(str(e)) from None
        return "relative error per layer " + tp.fmt_errors(errors)
    check("target stage equals the transformers forward, layer by layer", same_as_transformers)

    def steps():
        run = trainer.train(show_progress=False)
        if run.errors:
            raise CheckFailed("\n".join(f"{where}:\n{tb}" for where, tb in run.errors))
        if trainer.settings.compile and not all(w.graphs for w in run.workers):
            raise CheckFailed("a worker ran without its CUDA graph")
        return f"{run.workers[0].steps_done} steps" + (
            ", every worker compiled and captured its step" if trainer.settings.compile else "")
    check("compile + capture on every worker, steps run" if flags.compile else "steps run", steps)

    metrics = []

    def loss():
        with open(os.path.join(SCRATCH, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
        metrics.extend(r for r in records if "loss" in r)
        losses = [x["loss"] for x in metrics]
        if not all(map(lambda v: v == v and abs(v) != float("inf"), losses)):
            raise CheckFailed(f"non-finite loss: {losses}")
        unhealthy = [r["health"] for r in records if "health" in r]
        if unhealthy:
            raise CheckFailed(f"the training health check failed ({', '.join(unhealthy)}; the log says why): "
                              f"losses {losses}, gradient norms {[round(x['grad_norm'], 6) for x in metrics]}")
        if not losses[-1] < 0.98 * losses[0]:  # a real decrease, not a flat line that is finite
            raise CheckFailed(f"loss did not fall: {losses}")
        return " -> ".join(f"{v:.3f}" for v in losses)
    check("loss finite, falling, and training healthy", loss)

    def memory():
        if not metrics[0]["peak_mem_gb"]:
            return "no GPU (not measured on CPU)"
        first, last = metrics[1 if len(metrics) > 2 else 0]["peak_mem_gb"], metrics[-1]["peak_mem_gb"]
        grown = {d: (first[d], last[d]) for d in last if last[d] > first[d] * 1.01 + 0.01}
        if grown:
            raise CheckFailed(f"peak memory grew after warm-up (GB, first -> last): {grown}")
        return f"peak GB {last}"
    check("memory after warm-up does not grow", memory)

    def checkpoint():
        if trainer.finish() != 0:
            raise CheckFailed("the run did not finish cleanly (see the log above)")
        found = ck.find_checkpoint("auto", SCRATCH, trainer.log)
        if found is None:
            raise CheckFailed("no checkpoint was written")
        ckpt = found[0]
        worker = trainer.run.workers[0]
        loaded = dm.DFlashDraftModel.from_pretrained(ckpt, device=worker.device)
        for (n, p), q in zip(worker.drafter.named_parameters(), loaded.parameters()):
            if not torch.equal(p.detach(), q):
                raise CheckFailed(f"{ckpt}: {n} differs from the trained drafter")
        return f"{ckpt} loads with from_pretrained, weights equal"
    check("checkpoint saves and loads back", checkpoint)

    def throughput():
        last = metrics[-1]
        return (f"{last['tokens_per_s']:,.0f} tokens/s (real {last['real_tokens_per_s']:,.0f}), "
                f"{last['drafter_steps_per_s']:.2f} drafter steps/s, queues {last['queue_depths']}")
    check("tokens/s", throughput)
    stop(0)


if __name__ == "__main__":
    main()
