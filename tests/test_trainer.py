"""Tests of train_dflash_pipeline.py: the whole run end to end on the tiny CPU target (drafter workers,
gradient averaging, the schedule, the run's log and health, held-out measurements, signals and
faults), the warm-up's memory checks and the flat AdamW."""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import types

import pytest
import torch
from safetensors.torch import load_file

import dflash_model as dm
import train_dflash_pipeline as tp
from dflash_train import chat_data
from dflash_train import checkpoints as ck
from dflash_train import command_line as cli
from dflash_train import demo_assets
from dflash_train import evaluation
from dflash_train import helpers
from dflash_train import plots
from dflash_train import target_stage as ts
from dflash_train import throughput as thr
from conftest import ROOT, SCRIPT, chat_rows, metrics, pipeline_args, run_cli, run_interpreted, run_main, \
    steps_of, tiny_target, tiny_tokenizer, write_jsonl
from fault_inject import faulty_train_step


def test_end_to_end_two_workers(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(60))
    r = run_cli(tmp_path, tiny_model_dir, data, "--target-gpus", "cpu", "--drafter-gpus", "cpu,cpu",
                "--max-steps", "30", "--log-interval", "5", "--save-interval", "10", "--target-attention", "flex")
    assert r.returncode == 0, r.stdout + r.stderr
    m = metrics(tmp_path)
    assert [x["step"] for x in m] == [5, 10, 15, 20, 25, 30]
    assert m[-1]["loss"] < m[0]["loss"] * 0.9, [x["loss"] for x in m]
    out = tmp_path / "out"
    assert sorted(os.listdir(out / "checkpoints")) == ["step_10", "step_20", "step_30"]
    assert sorted(os.listdir(out / "final")) == ["config.json", "dflash_training.json", "model.safetensors"]
    record = json.loads((out / "final" / "dflash_training.json").read_text())
    assert record["chat_template_kwargs"] == {} and record["block_size"] == 4 and record["mask_token_id"] >= 0
    drafter = dm.DFlashDraftModel.from_pretrained(out / "final")
    assert drafter.block_size == 4 and len(drafter.layers) == 2
    log = (out / "train.log").read_text()
    assert "tok/s" in log and "tau" in log and "done: 30 steps" in log
    assert "split: target and drafter share ['cpu']" in log  # measured busy times, logged once
    assert "mask token" in log and "; sdpa attention" in log  # auto on CPU


def test_replicas_stay_identical(tmp_path, tiny_model_dir, monkeypatch):
    """Two workers, different batches each step: parameters are equal after every step."""
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(40))
    snapshots = []
    orig = tp.Run.write_metrics

    def spy(self, step):  # runs once both workers have finished `step`
        snapshots.append((step, [[p.detach().clone() for p in w.drafter.parameters()] for w in self.workers]))
        return orig(self, step)
    monkeypatch.setattr(tp.Run, "write_metrics", spy)
    args = pipeline_args(tmp_path / "o", tiny_model_dir, data, "--num-draft-layers", "1", "--lr", "6e-4",
                         "--max-steps", "4", "--target-gpus", "cpu", "--drafter-gpus", "cpu,cpu", "--log-interval", "1")
    assert tp.main(args) == 0
    assert [s[0] for s in snapshots] == [1, 2, 3, 4]
    for step, (p0, p1) in snapshots:
        for a, b in zip(p0, p1):
            assert torch.equal(a, b), step
    assert not all(torch.equal(a, b) for a, b in zip(snapshots[0][1][0], snapshots[-1][1][0]))


@pytest.mark.parametrize("stages", [2, 3])
def test_a_target_split_in_stages_trains_exactly_like_one_replica(tmp_path, tiny_model_dir, stages):
    """The same run with the target whole and split over two or three stages (the CPU standing
    for each stage's GPU): the same losses at every step and the same final drafter."""
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(40))
    common = ["--drafter-gpus", "cpu", "--max-steps", "3", "--log-interval", "1", "--target-layer-ids", "1,3"]
    assert tp.main(pipeline_args(tmp_path / "whole", tiny_model_dir, data, "--target-gpus", "cpu", *common)) == 0
    assert tp.main(pipeline_args(tmp_path / "split", tiny_model_dir, data, "--target-gpus", ",".join(["cpu"] * stages),
                                 "--target-stages", str(stages), *common)) == 0
    losses = [[r["loss"] for r in map(json.loads, open(tmp_path / run / "metrics.jsonl")) if "loss" in r]
              for run in ("whole", "split")]
    assert len(losses[0]) == 3 and losses[0] == pytest.approx(losses[1], rel=1e-6, abs=0)
    whole, split = (load_file(tmp_path / run / "final" / "model.safetensors") for run in ("whole", "split"))
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=1e-5, atol=1e-6)


def test_sharded_optimizer_state_trains_exactly_like_the_whole_one(tmp_path, tiny_model_dir):
    """Two workers, each keeping and updating the AdamW state of its share of the parameters
    (--shard-optimizer), against two workers with the whole state: the same losses, the same
    drafter, and checkpoints holding the same optimizer state (an unsharded AdamW's), from
    which a run without sharding resumes as from its own."""
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(40))
    common = ["--target-gpus", "cpu", "--drafter-gpus", "cpu,cpu", "--log-interval", "1", "--save-interval", "2"]
    assert tp.main(pipeline_args(tmp_path / "whole", tiny_model_dir, data, *common, "--max-steps", "4")) == 0
    assert tp.main(pipeline_args(tmp_path / "shard", tiny_model_dir, data, *common, "--max-steps", "4",
                                 "--shard-optimizer")) == 0
    losses = [[r["loss"] for r in map(json.loads, open(tmp_path / run / "metrics.jsonl")) if "loss" in r]
              for run in ("whole", "shard")]
    assert len(losses[0]) == 4 and losses[0] == losses[1]
    assert "AdamW state sharded over 2 workers" in (tmp_path / "shard" / "train.log").read_text()
    assert "AdamW state sharded" not in (tmp_path / "whole" / "train.log").read_text()
    for step in ("step_2", "step_4"):
        states = [torch.load(tmp_path / run / "checkpoints" / step / "training_state.pt", weights_only=True)["optimizer"]
                  for run in ("whole", "shard")]
        assert states[0]["param_groups"][0]["params"] == states[1]["param_groups"][0]["params"]
        assert sorted(states[0]["state"]) == sorted(states[1]["state"]) and len(states[0]["state"]) > 10
        for k, st in states[0]["state"].items():
            for name, value in st.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(states[1]["state"][k][name])), (k, name)
    whole, shard = (load_file(tmp_path / run / "final" / "model.safetensors") for run in ("whole", "shard"))
    assert all(torch.equal(whole[k], shard[k]) for k in whole)
    # the sharded run's checkpoint resumed without sharding, and the whole run's with it
    for run, flag in (("shard", "--no-shard-optimizer"), ("whole", "--shard-optimizer")):
        assert tp.main(pipeline_args(tmp_path / run, tiny_model_dir, data, *common, "--max-steps", "6", flag,
                                     "--resume", "auto")) == 0
    resumed = [load_file(tmp_path / run / "final" / "model.safetensors") for run in ("whole", "shard")]
    assert all(torch.equal(resumed[0][k], resumed[1][k]) for k in resumed[0])


def test_shares_of_the_parameters_are_contiguous_balanced_and_whole():
    params = [torch.empty(n) for n in (100, 5, 5, 90, 10, 3, 200, 7)]
    shares = tp.shard_ranges(params, 3)
    assert shares[0][0] == 0 and shares[-1][1] == len(params)
    assert all(a < b for a, b in shares) and all(b == c for (_, b), (c, _) in zip(shares, shares[1:]))
    sizes = [sum(p.numel() for p in params[a:b]) for a, b in shares]
    assert max(sizes) <= 210 and min(sizes) >= 100, sizes
    assert tp.shard_ranges(params[:2], 2) == [(0, 1), (1, 2)]


def test_fault_in_worker_stops_run_promptly(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(40))
    t0 = time.time()
    r = run_cli(tmp_path, tiny_model_dir, data, "--target-gpus", "cpu", "--drafter-gpus", "cpu,cpu",
                "--max-steps", "1000", fault_at=3, timeout=120)
    assert r.returncode == 1
    assert "fault injected at step 3" in r.stderr and "Traceback" in r.stderr
    assert time.time() - t0 < 120


def test_malformed_rows_counted_not_fatal(tmp_path, tiny_model_dir):
    rows = chat_rows(30) + ["{not json", json.dumps({"messages": []}),
                            json.dumps({"messages": [{"role": "wizard", "content": "x"}]}),
                            json.dumps({"messages": [{"role": "user", "content": "only a question"}]})]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    r = run_cli(tmp_path, tiny_model_dir, data, "--max-steps", "2", "--target-gpus", "cpu", "--drafter-gpus", "cpu")
    assert r.returncode == 0, r.stderr
    assert "34 rows (4 skipped)" in r.stdout
    assert "skipped rows: 1 x bad JSON: Expecting property name enclosed in double quotes (e.g. d.jsonl:31)" in r.stdout
    assert "1 x unknown role 'wizard' (e.g. d.jsonl:33)" in r.stdout
    assert "1 x no assistant turn (e.g. d.jsonl:34)" in r.stdout and "1 x empty conversation" in r.stdout
    assert "warning: skipping" not in r.stdout  # summarised, never row by row


def test_mostly_bad_corpus_and_missing_file_refused(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "d.jsonl", ["{bad"] * 10 + [json.dumps(chat_rows(1)[0])])
    r = run_cli(tmp_path, tiny_model_dir, data, "--max-steps", "2")
    assert r.returncode == 2 and "malformed" in r.stderr
    r = run_cli(tmp_path, tiny_model_dir, str(tmp_path / "missing.jsonl"), "--max-steps", "2")
    assert r.returncode == 2 and "no such file" in r.stderr


def test_assistant_only_loss_mask():
    tok = tiny_tokenizer()
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "q"}, {"role": "assistant", "content": "ab"}]
    (ids, mask), = chat_data.conversation_documents(tok, msgs, 128, {}, chat_data.DocumentStats(), "test")
    text = "".join(tok.convert_ids_to_tokens(i) for i, m in zip(ids, mask) if m)
    assert text == "yo<|end|>ab<|end|>"


def test_eval_interval_logs_measured_acceptance_next_to_tau_hat(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(40))
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "the cat sat"}, {"prompt": "a dog ran"}])
    r = run_cli(tmp_path, tiny_model_dir, data, "--target-gpus", "cpu", "--drafter-gpus", "cpu", "--max-steps", "6",
                "--log-interval", "3", "--eval-interval", "3", "--eval-data", prompts, "--eval-max-new-tokens", "8",
                "--eval-prompts", "2", "--val-fraction", "0.2", "--val-rows", "2")
    assert r.returncode == 0, r.stderr
    evals = [x for x in metrics(tmp_path) if "eval_acceptance_length" in x]
    assert [x["step"] for x in evals] == [3]  # step 6, the last: the final evaluation's, measured once
    assert all(x["eval_lossless"] and x["eval_acceptance_length"] >= 1.0 for x in evals)
    assert r.stdout.count("eval step") == 1 and "eval: acceptance length" in r.stdout and "tau_hat" in r.stdout
    assert "replayed on held-out training documents" in r.stdout  # the validation just before, beside it
    with open(tmp_path / "out" / "final" / "eval_acceptance.json") as f:
        assert json.load(f)["lossless"]


def test_sigterm_saves_and_exits_cleanly(tmp_path, tiny_model_dir):
    import signal
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(40))
    cmd = [sys.executable, SCRIPT, *pipeline_args(
        tmp_path / "out", tiny_model_dir, data, "--num-draft-layers", "1", "--lr", "6e-4", "--max-steps", "100000",
        "--log-interval", "1", "--save-interval", "100000", "--target-gpus", "cpu", "--drafter-gpus", "cpu,cpu")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    for line in proc.stdout:
        if "step 5/" in line:
            proc.send_signal(signal.SIGTERM)
            break
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    steps = ck.checkpoint_steps(str(tmp_path / "out"))
    assert len(steps) == 1 and steps[0] >= 5
    assert os.path.exists(tmp_path / "out" / "final" / "model.safetensors")


def test_non_finite_loss_stops_naming_the_step(tmp_path, tiny_model_dir, monkeypatch, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(40))
    real = dm.DFlashDraftModel.forward
    calls = []

    def poisoned(self, *a, **k):
        loss, stats = real(self, *a, **k)
        calls.append(1)
        return (loss * float("nan") if len(calls) == 5 else loss), stats
    monkeypatch.setattr(dm.DFlashDraftModel, "forward", poisoned)
    args = pipeline_args(tmp_path / "o", tiny_model_dir, data, "--num-draft-layers", "1", "--lr", "6e-4",
                         "--max-steps", "12", "--target-gpus", "cpu", "--drafter-gpus", "cpu", "--log-interval", "3",
                         "--save-interval", "3")
    assert tp.main(args) == 1
    assert ck.checkpoint_steps(str(tmp_path / "o")) == [3]  # nothing saved from step 5 on
    log = (tmp_path / "o" / "train.log").read_text()
    assert "stopped after an error" in log
    assert "non-finite loss at step 5" in capsys.readouterr().err


GB = 2**30


@pytest.fixture
def fake_gpu_memory(monkeypatch):
    """GPU memory faked on CPU: 100 GB free, and a one-row step's peak is whatever the test sets
    in the returned dict's "bytes"."""
    peak = {"bytes": 0}
    fake_cuda = {"empty_cache": lambda: None, "reset_peak_memory_stats": lambda device: None,
                 "memory_allocated": lambda device: 0, "max_memory_allocated": lambda device: peak["bytes"],
                 "mem_get_info": lambda device: (100 * GB, 140 * GB)}
    for name, fn in fake_cuda.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    return peak


@pytest.mark.parametrize("stage", ["target stage", "drafter step"])
def test_a_row_too_long_for_the_gpu_is_refused_naming_what_would_fit(fake_gpu_memory, stage):
    """Long rows (--max-length 32768) where not even one row fits: the refusal names the knobs
    that shrink a row's memory (anchors for the drafter step), not a token budget of 0."""
    L = 32768
    fake_gpu_memory["bytes"] = 200 * GB  # one row's peak, above the 100 GB free
    settings = types.SimpleNamespace(token_budget=L, max_length=L, num_anchors=5461)

    def warm(rows):
        raise torch.cuda.OutOfMemoryError("fake: out of memory")
    error = helpers.budget_error(stage, "cuda:0", settings, warm, lambda: None, lambda: None)
    assert "not even one row fits" in error and "--max-length" in error and "--token-budget 0" not in error
    assert ("--num-anchors 5461" in error) == (stage == "drafter step"), error


def test_out_of_memory_at_start_up_names_a_budget_that_was_tried(fake_gpu_memory):
    # 1 GB per row by the one-row measurement, but a capture of more than 70 rows runs out of
    # memory (on an H200 a capture did not fit the one-row estimate). The estimate, 90 rows, is
    # tried, then 15% fewer each time: 90, 76, 64.
    L = 512
    captured = []

    class FakeReplica:
        device, graphs = "cuda:0", None

        def synthetic_batch(self, rows, length):
            return rows

        def outputs(self, rows):  # the one-row measurement
            fake_gpu_memory["bytes"] = rows * GB

        def capture(self, rows, length):
            captured.append(rows)
            if rows > 70:
                raise torch.cuda.OutOfMemoryError("fake: out of memory")
            self.graphs = ["a graph"]

        def drop_capture(self):
            self.graphs = None

    replica = FakeReplica()
    args = types.SimpleNamespace(token_budget=4096 * L, max_length=L, compile=True)
    with pytest.raises(chat_data.UsageError, match=f"1.0 GB per row of {L}.*the largest that fits is about --token-budget {64 * L}$"):
        ts.warm_up_target([replica], args, print)
    assert captured == [4096, 90, 76, 64]
    assert replica.graphs is None  # the tries' memory is let go


@pytest.mark.parametrize("compile", [False, True])
def test_drafter_out_of_memory_names_a_budget_that_then_warms_up(fake_gpu_memory, compile):
    # One row takes 1 GB, but its first run also holds 3 GB allocated once (compiling,
    # autotuning, first use). The estimate comes from a second run: 90 rows, then 15% fewer each
    # time. The budget the error names is what the next start-up is given, and it warms up as it
    # is, with or without --compile (no check against the estimate refuses it first).
    L = 512

    class FakeWorker:
        rank, device = 0, "cuda:0"
        warm_up = tp.DrafterWorker.warm_up
        settings = types.SimpleNamespace(token_budget=4096 * L, max_length=L, compile=compile)
        run = types.SimpleNamespace(log=print, target_hidden_size=2048)
        averager, flat_grad = tp.GradAverager(1), None
        warmed, one_row_runs = [], 0

        def synthetic_inputs(self, rows, target_hidden_size):
            return rows

        def forward_backward(self, rows):  # the one-row measurement
            self.one_row_runs += 1
            fake_gpu_memory["bytes"] = rows * GB + (3 * GB if self.one_row_runs == 1 else 0)

        def warm_step(self, rows):
            self.warmed.append(rows)
            if rows > 70:
                raise torch.cuda.OutOfMemoryError("fake: out of memory")

        def drop_capture(self):
            pass

    w = FakeWorker()
    with pytest.raises(RuntimeError, match=f"1.0 GB per row of {L}.*about --token-budget {64 * L}$"):
        w.warm_up()
    assert w.warmed == [4096, 90, 76, 64]
    w.settings.token_budget, w.warmed = 64 * L, []
    w.warm_up()
    assert w.warmed == [64]


def test_compiled_workers_never_fall_back_to_eager_silently():
    # Dynamo's default: 8 compiled versions per function, then eager without a word. Building a
    # --compile worker allows 64 (one per worker and shape) and makes the 65th an error.
    # config.patch restores both settings after the test (monkeypatch's undo deleted them from
    # dynamo's config module, and every later compile in the process failed)
    with torch._dynamo.config.patch(recompile_limit=8, fail_on_recompile_limit_hit=False):
        target = tiny_target(dtype=torch.float32)
        drafter = dm.DFlashDraftModel(dm.make_drafter_config(target.config, mask_token_id=1, num_draft_layers=1,
                                                             block_size=4))
        args = cli.Settings.of_flags(["--max-length", "64", "--token-budget", "128", "--num-anchors", "8", "--compile"],
                                    drafter_attention="sdpa")
        tp.DrafterWorker(0, torch.device("cpu"), drafter, args, tp.GradAverager(1), types.SimpleNamespace(log=print))
        torch._dynamo.reset()
        double = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
        for n in range(1, 65):
            double(torch.ones(n))
        with pytest.raises(Exception, match="recompile_limit|cache_size_limit"):
            double(torch.ones(65))
        torch._dynamo.reset()


@pytest.mark.parametrize("compile", [False, True])
def test_the_step_writes_every_gradient_into_the_flat_buffer(compile):
    # The backward overwrites each parameter's view of the flat buffer (flat_adamw.GradInto): no zeroing
    # before it, nothing accumulated into .grad. Pre-filled with 7, the buffer must end up holding
    # autograd's gradients of the same loss, eager and compiled (the GPU step's inductor path).
    torch._dynamo.reset()
    target = tiny_target(dtype=torch.float32)
    drafter = dm.DFlashDraftModel(dm.make_drafter_config(target.config, mask_token_id=1, num_draft_layers=2,
                                                         block_size=4)).attach_target(target)
    args = cli.Settings.of_flags(["--max-length", "48", "--token-budget", "96", "--num-anchors", "6"]
                                + (["--compile"] if compile else []), drafter_attention="sdpa")
    worker = tp.DrafterWorker(0, torch.device("cpu"), drafter, args, tp.GradAverager(1), types.SimpleNamespace(log=print))
    g = torch.Generator().manual_seed(0)
    R, L, F = 2, 48, len(drafter.target_layer_ids) * target.config.hidden_size
    doc = (torch.arange(L) >= 30).long().expand(R, L)
    inputs = [torch.randn(R, L, F, generator=g), torch.randint(0, 100, (R, L), generator=g), torch.ones(R, L),
              doc, torch.where(doc == 0, torch.arange(L), torch.arange(L) - 30), torch.rand(R, L, generator=g)]
    params = list(drafter.parameters())
    loss, _ = drafter(*inputs, num_anchors=6, gamma=args.loss_decay_gamma, ce_chunk_size=args.ce_chunk_size)
    want = torch.autograd.grad(loss, params)
    worker.flat_grad.fill_(7.0)
    if compile:
        from torch._inductor.utils import run_and_get_code
        (got_loss, _), code = run_and_get_code(worker.forward_backward, inputs)
        # The matmuls write the gradients of the weights used once (q, o, gate, up, down in each of
        # 2 layers, and fc) into the buffer themselves (flat_adamw.WeightGradsIntoBuffer); k/v_proj's, sums, are copied
        assert "\n".join(code).count("dflash.mm_into.default(") == 5 * 2 + 1
    else:
        got_loss, _ = worker.forward_backward(inputs)
    torch.testing.assert_close(got_loss, loss.detach())
    assert all(p.grad.data_ptr() == into.data_ptr() for _, p, into, _ in worker.grad_into)  # still the buffer's views
    for (name, p, _, _), w in zip(worker.grad_into, want):
        torch.testing.assert_close(p.grad, w, msg=name)
    torch._dynamo.reset()


def test_validation_documents_are_held_out_and_scored_beside_training(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(60))
    r = run_cli(tmp_path, tiny_model_dir, data, "--target-gpus", "cpu", "--drafter-gpus", "cpu", "--max-steps", "6",
                "--log-interval", "3", "--eval-interval", "3", "--val-fraction", "0.2", "--val-rows", "4")
    assert r.returncode == 0, r.stderr
    vals = [x for x in metrics(tmp_path) if "val_tau_hat" in x]
    assert [x["step"] for x in vals] == [3, 6]
    assert all(x["val_loss"] == x["val_loss"] and x["val_tau_hat"] >= 1.0 and len(x["val_acc_per_slot"]) == 3
               and 1.0 <= x["val_acceptance_length"] <= 4 and 1.0 <= x["val_acceptance_length_first_answers"] <= 4
               for x in vals)
    assert vals[1]["val_loss"] < vals[0]["val_loss"]  # the same rows and anchors each time: comparable
    assert "held out for validation (4 rows), never trained on" in r.stdout and "val step 6: loss" in r.stdout
    assert ", decoding replayed " in r.stdout
    assert os.path.getsize(tmp_path / "out" / "training.png") > 10_000


def test_split_advice_names_the_bound_stage_and_the_fastest_split():
    """The issue's figures: Qwen3-8B shapes, 4 x 3072 tokens, target forward 427 ms and drafter
    step 518 ms on an H200. 6+2 is drafter-bound at 2 x 12288 / 0.518 = 47.4K tokens/s; of 8 GPUs
    4+4 is fastest (min(4 x 28.8K, 4 x 23.7K) = 94.9K)."""
    gpu = lambda *i: [torch.device("cuda", k) for k in i]
    a = thr.split_advice(0.427, 0.518, gpu(0, 1, 2, 3, 4, 5), gpu(6, 7), 12288)
    assert a["bound"] == "drafter"
    assert a["expected_tokens_per_s"] == pytest.approx(2 * 12288 / 0.518)
    assert a["best"][:2] == (4, 4) and a["best"][2] == pytest.approx(4 * 12288 / 0.518)
    assert a["flags"] == "--target-gpus 0,1,2,3 --drafter-gpus 4,5,6,7"
    assert "drafter-bound" in a["line"] and "4+4" in a["line"] and a["flags"] in a["line"]
    # a fast drafter: the target bounds 1+1, and 1+1 is already the best split of two GPUs
    b = thr.split_advice(0.4, 0.1, gpu(0), gpu(1), 12288)
    assert b["bound"] == "target" and b["best"][:2] == (1, 1) and b["flags"] is None
    assert b["expected_tokens_per_s"] == pytest.approx(12288 / 0.4)
    # one device shared: times taken beside each other, the stages overlapping, the slower bounds
    c = thr.split_advice(0.2, 0.3, gpu(0), gpu(0), 1000)
    assert c["bound"] == "shared" and c["expected_tokens_per_s"] == pytest.approx(1000 / 0.3)


def test_the_built_in_target_is_evaluated_on_mt_bench_whatever_it_trains_on(tmp_path):
    """The final evaluation of the built-in target defaults to MT-Bench with any --data (the
    human-reply comparison run typed a file and was evaluated on nothing); --eval-data wins; any
    other target has no default."""
    parser = cli.build_parser()
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(3))
    mtbench = evaluation.read_prompts(demo_assets.mtbench_file())
    assert len(mtbench) == 80
    for argv in ([], ["--data", str(data)], ["--data", demo_assets.BUILTIN_DATA]):
        args = parser.parse_args(argv)
        assert evaluation.heldout_prompts(args, None, 80) == [(c, t[:1]) for c, t in mtbench]
    mine = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hello there"}])
    assert evaluation.heldout_prompts(parser.parse_args(["--data", str(data), "--eval-data", str(mine)]), None, 5) == \
        [("p", ["hello there"])]  # no category: the file's name
    assert evaluation.heldout_prompts(parser.parse_args(["--target-model", "some/model", "--data", str(data)]), None, 5) == []


def test_decay_ratio_holds_the_peak_then_decays_to_zero():
    args = types.SimpleNamespace(max_steps=100, epochs=None, warmup_ratio=0.1, decay_ratio=0.2)
    schedule = ck.planned_schedule(args, batches_per_epoch=7, num_workers=2)
    assert schedule == {"total_batches": 200, "warmup_batches": 20, "decay_batches": 40}
    lr = [tp.scheduled_lr(b, schedule, 1.0) for b in range(201)]
    assert lr[10] == pytest.approx(0.5) and lr[20] == 1.0
    assert all(x == 1.0 for x in lr[20:161])                  # held until the last 20% of steps
    assert lr[180] == pytest.approx(0.5) and lr[200] == pytest.approx(0.0)
    assert all(a > b for a, b in zip(lr[160:200], lr[161:201]))
    # 1.0 (the default) is cosine over everything after the warm-up
    full = ck.planned_schedule(types.SimpleNamespace(**{**vars(args), "decay_ratio": 1.0}), 7, 2)
    assert full["decay_batches"] == 180
    for b in (0, 20, 21, 110, 199, 200):
        expect = b / 20 if b <= 20 else 0.5 * (1 + math.cos(math.pi * (b - 20) / 180))
        assert tp.scheduled_lr(b, full, 1.0) == pytest.approx(expect)


FLAT_ADAMW_CHECK = """
import sys, copy, torch
sys.path.insert(0, sys.argv[1])
from dflash_train import flat_adamw as fa
torch.manual_seed(0)
init = [torch.randn(s) for s in [(37, 5), (11,), (3, 4, 6)]]
n, lr, wd = sum(p.numel() for p in init), 0.05, 0.1

def flat_adamw(params):  # as DrafterWorker builds it: the gradients are views of the flat buffer
    flat_grad = torch.zeros(n)
    opt = fa.FlatAdamW(params, flat_grad, torch.tensor(lr), wd)
    for p, g in zip(params, fa.flat_views(flat_grad, params)):
        p.grad = g
    return opt

ref = [p.clone().requires_grad_() for p in init]
ref_opt = torch.optim.AdamW(ref, lr=lr, weight_decay=wd, foreach=False)
mine = [p.clone().requires_grad_() for p in init]
opt = flat_adamw(mine)
for step in range(5):
    g = torch.randn(n) * (10 if step == 2 else 1)
    clip = torch.clamp(1.0 / (g.norm() + 1e-6), max=1.0)  # every step clipped (the norm is about 17)
    opt.flat_grad.copy_(g)
    for p, gp in zip(ref, fa.flat_views(g * clip, ref)):
        p.grad = gp
    ref_opt.step()
    opt.step(clip)
    for p, q, q_bf16 in zip(ref, mine, opt.bf16_weights):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
        # within one bf16 step: the interpreter truncates where the GPU rounds (tests/test_gpu.py: equal)
        torch.testing.assert_close(q_bf16.float(), q.detach().float(), rtol=2 ** -7, atol=0)
    assert [p.data_ptr() for p in mine] == [v.data_ptr() for v in fa.flat_views(opt.flat_param, mine)]
# Its state_dict loads into torch's AdamW (with that one's own settings kept, as
# DrafterWorker.load_optimizer_state does), torch's into it, and all three go on as one.
state = copy.deepcopy(opt.state_dict())
for a, b in zip(state["state"].values(), ref_opt.state_dict()["state"].values()):
    torch.testing.assert_close(a["exp_avg_sq"], b["exp_avg_sq"], rtol=1e-6, atol=1e-7)
    assert float(a["step"]) == float(b["step"]) == 5
torchs = [p.detach().clone().requires_grad_() for p in mine]
torchs_opt = torch.optim.AdamW(torchs, lr=lr, weight_decay=wd, foreach=False)
own = {k: v for k, v in torchs_opt.param_groups[0].items() if k != "params"}
torchs_opt.load_state_dict(state)
torchs_opt.param_groups[0].update(own)
loaded = [p.detach().clone().requires_grad_() for p in ref]
loaded_opt = flat_adamw(loaded)
loaded_opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
st = loaded_opt.state[loaded[1]]  # the loaded moments are the kernel's flat buffers again
assert st["exp_avg"].data_ptr() == fa.flat_views(loaded_opt.exp_avg, loaded)[1].data_ptr() and float(st["step"]) == 5
g = torch.randn(n)
loaded_opt.flat_grad.copy_(g)
for p, q, gp in zip(torchs, ref, fa.flat_views(g, ref)):
    p.grad, q.grad = gp.clone(), gp.clone()
torchs_opt.step(); ref_opt.step(); loaded_opt.step(torch.tensor(1.0))
for p, q, r in zip(torchs, ref, loaded):
    torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(r, q, rtol=1e-6, atol=1e-7)
# The CUDA worker's buffer is bf16 (what the matmuls write): the kernel updates from its fp32 values.
halves = [p.clone().requires_grad_() for p in init]
halves_opt = fa.FlatAdamW(halves, torch.zeros(n, dtype=torch.bfloat16), torch.tensor(lr), wd)
upcast = [p.clone().requires_grad_() for p in init]
upcast_opt = torch.optim.AdamW(upcast, lr=lr, weight_decay=wd, foreach=False)
for step in range(3):
    g = torch.randn(n).to(torch.bfloat16)
    halves_opt.flat_grad.copy_(g)
    for p, gp in zip(upcast, fa.flat_views(g.float(), upcast)):
        p.grad = gp
    upcast_opt.step(); halves_opt.step(torch.tensor(1.0))
for p, q in zip(upcast, halves):
    torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
print("ok")
"""


def test_flat_adamw_is_torchs_adamw_on_the_clipped_gradient_interpreted():
    # The CUDA workers' optimizer (one Triton kernel over flat buffers), run by Triton's
    # interpreter on the CPU: 5 steps equal torch's for-loop AdamW on the clipped gradient (one
    # step clipped hard), its bf16 copy follows the weights, and its state_dict and torch's load
    # into each other and go on as one. tests/test_gpu.py runs it compiled.
    run_interpreted(FLAT_ADAMW_CHECK)


def test_the_modules_import_one_way():
    # dflash_model imports none of the project's modules; no module imports scripts/ (they are
    # leaves); the trainer is imported by scripts and tests only.
    import ast
    modules = [f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")]
    imports = {}
    for m in modules:
        with open(os.path.join(ROOT, m + ".py")) as f:
            tree = ast.parse(f.read())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        imports[m] = {n.split(".")[0] for n in names}
    assert not imports["dflash_model"] & set(modules)
    assert all("scripts" not in imported for imported in imports.values())
    assert [m for m, imported in imports.items() if "train_dflash_pipeline" in imported] == []


def test_evaluations_at_a_temperature_beside_greedy(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(40))
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "the cat"}, {"prompt": "a dog ran"}])
    args = pipeline_args(tmp_path / "o", tiny_model_dir, data, "--target-gpus", "cpu", "--drafter-gpus", "cpu",
                         "--num-draft-layers", "1", "--max-steps", "4", "--log-interval", "2", "--eval-interval", "2",
                         "--eval-data", prompts, "--eval-prompts", "2", "--eval-max-new-tokens", "8",
                         "--eval-temperature", "1.0", "--val-fraction", "0.2", "--val-interval", "2")
    assert tp.main(args) == 0
    with open(tmp_path / "o" / "metrics.jsonl") as f:
        evals = [r for r in map(json.loads, f) if "eval_acceptance_length" in r]
    assert evals and all(r["eval_temperature"] == 1.0 and r["eval_sampled_acceptance_length"] >= 1 for r in evals)
    with open(tmp_path / "o" / "metrics.jsonl") as f:
        vals = [r for r in map(json.loads, f) if "val_tau_hat" in r]
    assert vals and all(1 <= r["val_sampled_tau_hat"] <= r["val_tau_hat"] + 0.5 for r in vals)
    report = json.loads((tmp_path / "o" / "final" / "eval_acceptance.json").read_text())
    assert report["lossless"] and report["sampled"]["temperature"] == 1.0 and report["sampled"]["lossless"] is None
    assert len(report["acceptance_per_slot"]) == 3 and report["prompt_files"][0]["file"] == prompts


def test_a_distillation_run_trains_records_its_loss_and_resumes_only_with_it(tmp_path, tiny_model_dir, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(40))
    args = pipeline_args(tmp_path / "o", tiny_model_dir, data, "--target-gpus", "cpu", "--drafter-gpus", "cpu",
                         "--max-steps", "4", "--log-interval", "2", "--save-interval", "2", "--loss", "mix",
                         "--kl-weight", "0.25", "--distill-top-k", "16", "--distill-temperature", "2")
    assert tp.main(args) == 0
    with open(tmp_path / "o" / "metrics.jsonl") as f:
        steps = [r for r in map(json.loads, f) if "loss" in r and "step" in r]
    assert [r["step"] for r in steps] == [2, 4] and all(math.isfinite(r["loss"]) for r in steps)
    recorded = dm.read_training_record(tmp_path / "o" / "final")
    assert recorded["distillation"] == {"kl_weight": 0.25, "temperature": 2.0, "top_k": 16}
    # Another loss is another run: resuming it under --loss ce is refused, naming the difference
    capsys.readouterr()
    assert tp.main(args[:-8] + ["--max-steps", "6", "--resume", "auto"]) == 2
    assert "distillation {'kl_weight': 0.25" in capsys.readouterr().err


def test_a_vanished_output_directory_stops_the_run_with_a_checkpoint(tmp_path, tiny_model_dir, monkeypatch):
    real = tp.DrafterWorker.train_step

    def train_step(worker, step, batch):
        if step == 3:
            shutil.rmtree(tmp_path / "o")
        return real(worker, step, batch)
    monkeypatch.setattr(tp.DrafterWorker, "train_step", train_step)
    assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "50", "--save-interval", "100") == 1
    assert steps_of(tmp_path) == [3]  # saved into the recreated directory, then stopped


def test_a_metrics_file_deleted_mid_run_is_recreated_and_said(tmp_path, tiny_model_dir, monkeypatch):
    real = tp.DrafterWorker.train_step

    def train_step(worker, step, batch):
        if step == 3:
            os.remove(tmp_path / "o" / "metrics.jsonl")
        return real(worker, step, batch)
    monkeypatch.setattr(tp.DrafterWorker, "train_step", train_step)
    assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "5") == 0
    with open(tmp_path / "o" / "metrics.jsonl") as f:
        steps = sorted({json.loads(line)["step"] for line in f})
    assert steps == [3, 4, 5]
    assert "metrics.jsonl was deleted during the run: recreated at step 3" in (tmp_path / "o" / "train.log").read_text()
    assert (tmp_path / "o" / "training.png").exists()
    # the plots of a run directory without metrics say so, and draw nothing
    os.remove(tmp_path / "o" / "metrics.jsonl")
    said = []
    assert plots.run_records(str(tmp_path / "o"), said.append)[0] == [] and "does not exist" in said[0]


def test_a_dead_run_is_said_in_the_log_and_fails_the_smoke_test(tmp_path, tiny_model_dir):
    assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "12", "--lr", "1e6") == 0
    log = (tmp_path / "o" / "train.log").read_text()
    assert "health: step" in log
    with open(tmp_path / "o" / "metrics.jsonl") as f:
        assert any("health" in json.loads(line) for line in f)
    # a healthy run says nothing of the kind
    assert run_main(tmp_path, tiny_model_dir, "ok", "--max-steps", "12") == 0
    assert "health:" not in (tmp_path / "ok" / "train.log").read_text()
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(60))
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "smoke_test.py"), "--target-model", tiny_model_dir, "--data",
           data, "--cache-dir", str(tmp_path / "c"), "--max-length", "128", "--token-budget", "256", "--num-anchors",
           "16", "--block-size", "4", "--num-draft-layers", "2", "--lr", "1e6", "--target-gpus", "cpu",
           "--drafter-gpus", "cpu", "--smoke-steps", "16"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "TMPDIR": str(tmp_path)})
    assert r.returncode == 1 and "[FAIL] loss finite, falling, and training healthy" in r.stdout, r.stdout[-2000:]


def test_a_torn_metrics_line_is_skipped_by_every_reader(tmp_path, tiny_model_dir):
    assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "4", "--save-interval", "2") == 0
    with open(tmp_path / "o" / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 1.')  # torn by a full disk
    said = []
    recs, _ = plots.run_records(str(tmp_path / "o"), said.append)
    assert max(r["step"] for r in recs) == 4 and "not a whole record" in said[0]
    # a resumed run drops it, and the records of steps it redoes
    assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "6", "--save-interval", "2", "--resume", "auto") == 0
    with open(tmp_path / "o" / "metrics.jsonl") as f:
        steps = [json.loads(line)["step"] for line in f if "loss" in json.loads(line)]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_steps_redone_after_a_kill_are_recorded_once(tmp_path, tiny_model_dir, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(tp.DrafterWorker, "train_step", faulty_train_step(4))
        assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "6", "--save-interval", "2") == 1
    assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "6", "--save-interval", "2", "--resume", "auto") == 0
    with open(tmp_path / "o" / "metrics.jsonl") as f:
        steps = [r["step"] for r in map(json.loads, f) if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_a_signal_during_the_final_evaluation_stops_it_and_keeps_the_drafter(tmp_path, tiny_model_dir, monkeypatch,
                                                                             capsys):
    finished = []

    def long_evaluation(self, final_dir):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(200):
            time.sleep(0.01)
        finished.append(final_dir)
    monkeypatch.setattr(tp.Trainer, "evaluate_final", long_evaluation)
    assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "2", "--eval-prompts", "1") == 0
    assert not finished
    out = capsys.readouterr().out
    assert "the evaluation stopped where it was" in out and "is skipped" not in out, out
    assert (tmp_path / "o" / "final" / "model.safetensors").exists() and ck.checkpoint_steps(str(tmp_path / "o")) == [2]


def test_a_signal_while_finishing_is_noted_not_raised():
    seen, before = [], {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with helpers.signals_handled(seen.append):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
    assert seen == [signal.SIGINT]
    # the old handlers are back after (whatever they are: a process started in the background
    # by a shell without job control ignores SIGINT from the start)
    assert {s: signal.getsignal(s) for s in before} == before
