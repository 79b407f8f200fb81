import copy
import json
import math
import os
import random
import subprocess
import sys
import time
import types

import pytest
import torch

import chat_data
import demo_assets
import evaluation
import regeneration
import target_model
import dflash_model as dm
import train_dflash_pipeline as tp
from conftest import run_interpreted, tiny_tokenizer, write_jsonl
from fault_inject import faulty_train_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = "the cat sat on a mat and then it ran to see the dog who was very happy".split()


def chat_rows(n, seed=0):
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        q = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10)))
        a = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(rng.randint(8, 30)))
        if i % 2:
            rows.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
        else:
            rows.append({"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]})
    return rows


SCRIPT = os.path.join(ROOT, "train_dflash_pipeline.py")
FAULT = os.path.join(ROOT, "tests", "fault_inject.py")  # the trainer with a worker that fails at a step


def pipeline_args(out, model_dir, data, *extra):
    """A small run of the tiny target into `out` (later flags in `extra` win)."""
    return ["--target-model", model_dir, "--data", data, "--output-dir", str(out), "--cache-dir",
            str(out.parent / "cache"), "--max-length", "128", "--token-budget", "256", "--num-anchors", "16",
            "--block-size", "4", "--num-draft-layers", "2", "--lr", "1e-2", "--eval-prompts", "0", *extra]


def run_cli(tmp_path, model_dir, data, *extra, timeout=600, fault_at=None):
    program = [SCRIPT] if fault_at is None else [FAULT, str(fault_at), "train"]
    cmd = [sys.executable, *program, *pipeline_args(tmp_path / "out", model_dir, data, *extra)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def metrics(tmp_path):
    with open(tmp_path / "out" / "metrics.jsonl") as f:
        return [json.loads(l) for l in f]


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
    from safetensors.torch import load_file
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


def test_each_stage_of_a_split_replica_is_timed_on_its_own_clock(tiny_model_dir):
    """The target stage's busy time (its tokens/s in the log, the split advice) is the slowest
    replica stage's: each stage's work is timed by its own clock, eagerly and as the pipeline
    feeds it."""
    (replica,), _, _ = tp.load_target_replicas(tiny_model_dir, [torch.device("cpu")] * 2, [1, 3],
                                               log=lambda *a: None, stages=2)
    clocks = [tp.StageClock(), tp.StageClock()]
    batch = {"input_ids": torch.randint(3, 100, (2, 64)), "position_ids": torch.arange(64).repeat(2, 1),
             "doc_ids": torch.zeros(2, 64, dtype=torch.long)}
    for _ in range(3):
        replica.outputs(batch, clocks)
    assert [c.total()[1] for c in clocks] == [3, 3] and all(c.total()[0] > 0 for c in clocks)


def test_sharded_optimizer_state_trains_exactly_like_the_whole_one(tmp_path, tiny_model_dir):
    """Two workers, each keeping and updating the AdamW state of its share of the parameters
    (--shard-optimizer), against two workers with the whole state: the same losses, the same
    drafter, and checkpoints holding the same optimizer state (an unsharded AdamW's), from
    which a run without sharding resumes as from its own."""
    from safetensors.torch import load_file
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
        states = [torch.load(tmp_path / run / "checkpoints" / step / "training_state.pt", weights_only=False)["optimizer"]
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


def test_resume_equals_uninterrupted(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(40))
    common = ["--target-gpus", "cpu", "--drafter-gpus", "cpu,cpu", "--max-steps", "8", "--log-interval", "1",
              "--save-interval", "4"]
    full = tmp_path / "full"; full.mkdir()
    r = run_cli(full, tiny_model_dir, data, *common)
    assert r.returncode == 0, r.stderr
    part = tmp_path / "part"; part.mkdir()
    r = run_cli(part, tiny_model_dir, data, *common[:-4], "--max-steps", "8", "--log-interval", "1",
                "--save-interval", "4", fault_at=6)
    assert r.returncode != 0
    assert sorted(os.listdir(part / "out" / "checkpoints")) == ["step_4"]
    r = run_cli(part, tiny_model_dir, data, *common, "--resume", "auto")
    assert r.returncode == 0, r.stderr
    lf = {x["step"]: x["loss"] for x in metrics(full)}
    lp = {x["step"]: x["loss"] for x in metrics(part)}
    for s in range(5, 9):
        assert lf[s] == lp[s], (s, lf[s], lp[s])
    # the training time goes on from the checkpoint's, not from zero
    first, resumed = [x for x in metrics(part) if "loss" in x][:5], [x for x in metrics(part) if "loss" in x][-4:]
    assert [x["step"] for x in first[:4]] == [1, 2, 3, 4] and resumed[0]["step"] == 5
    assert resumed[0]["elapsed_s"] >= first[3]["elapsed_s"] > 0
    assert all(a["elapsed_s"] <= b["elapsed_s"] for a, b in zip(resumed, resumed[1:]))


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


@pytest.mark.parametrize("extra,msg", [
    (["--token-budget", "64"], "smaller than --max-length"),
    (["--block-size", "200"], "--block-size 200 does not fit"),
    (["--target-gpus", "0", "--drafter-gpus", "7"], "does not exist"),
    (["--target-gpus", "cpu", "--drafter-gpus", "cpu", "--compile"], "--compile captures CUDA graphs"),
    (["--loss", "mix", "--kl-weight", "1"], "--kl-weight 1.0 must be in (0, 1)"),
    (["--loss", "kl", "--distill-top-k", "129"], "larger than the target's vocabulary (128)"),
])
def test_impossible_settings_refused(tmp_path, tiny_model_dir, extra, msg):
    r = run_cli(tmp_path, tiny_model_dir, "unused.jsonl", *extra)
    assert r.returncode == 2 and msg in r.stderr, r.stderr


def test_encoder_decoder_target_refused(tmp_path):
    from transformers import T5Config
    T5Config(d_model=32, num_layers=1, num_heads=2, d_kv=16, d_ff=32, vocab_size=50).save_pretrained(tmp_path / "t5")
    r = run_cli(tmp_path, str(tmp_path / "t5"), "unused.jsonl")
    assert r.returncode == 2 and "not a decoder-only causal LM" in r.stderr


def test_assistant_only_loss_mask():
    tok = tiny_tokenizer()
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "q"}, {"role": "assistant", "content": "ab"}]
    (ids, mask), = chat_data.conversation_documents(tok, msgs, 128, {}, chat_data.DocumentStats(), "test")
    text = "".join(tok.convert_ids_to_tokens(i) for i, m in zip(ids, mask) if m)
    assert text == "yo<|end|>ab<|end|>"


def test_packing_deterministic_and_complete():
    lengths = [5, 9, 30, 2, 17, 8, 8, 25, 31, 1]
    a = tp.pack_epoch(lengths, 32, seed=1, epoch=0)
    assert a == tp.pack_epoch(lengths, 32, seed=1, epoch=0)
    assert a != tp.pack_epoch(lengths, 32, seed=1, epoch=1)
    assert sorted(d for r in a for d in r) == list(range(10))
    assert all(sum(lengths[d] for d in r) <= 32 for r in a)


@pytest.mark.parametrize("tile", [128, 64])
@pytest.mark.parametrize("window", [None, 200])
def test_document_block_mask_tiles_equal_the_rule_counted_pair_by_pair(window, tile):
    """The target's BlockMask classifies tiles from their first and last documents and positions;
    counted pair by pair (document_visible at every query and key) the full tiles are the same,
    and so are the partial ones without a window (with one, they may be more: the rule inside the
    kernel still decides)."""
    g = torch.Generator().manual_seed(0)
    L = 700
    rows = []
    for r in range(6):
        cuts = sorted(torch.randint(1, L, (r + 1,), generator=g).tolist())
        doc = torch.full((L,), -1, dtype=torch.long)
        for i, (s, e) in enumerate(zip([0] + cuts[:-1], cuts)):
            doc[s:e] = i
        if r % 2:  # no padding: the last document runs to the end
            doc[cuts[-1]:] = len(cuts)
        rows.append(doc)
    doc_ids = torch.stack(rows)
    bm = tp.document_block_mask(doc_ids, window, tile)
    n = -(-L // tile)
    pos = torch.arange(n * tile)
    docs = torch.nn.functional.pad(doc_ids, (0, n * tile - L), value=-1)
    seen = tp.document_visible(pos[:, None], pos[None, :], docs[:, :, None], docs[:, None, :], window)
    seen = seen & (pos[:, None] < L) & (pos[None, :] < L)
    pairs = seen.view(len(rows), n, tile, n, tile).sum((2, 4))
    full_ref, some_ref = pairs == tile * tile, pairs > 0

    def as_map(num, idx):
        m = torch.zeros(len(rows), n, n, dtype=torch.bool)
        for r in range(len(rows)):
            for q in range(n):
                m[r, q, idx[r, 0, q, :num[r, 0, q]].long()] = True
        return m

    full = as_map(bm.full_kv_num_blocks, bm.full_kv_indices)
    some = as_map(bm.kv_num_blocks, bm.kv_indices) | full
    assert torch.equal(full, full_ref)
    if window is None:
        assert torch.equal(some, some_ref)
    else:
        assert (some_ref <= some).all()


@pytest.mark.parametrize("attention,lengths,mask_tile", [("dense", (7, 12, 5), None), ("flex", (7, 12, 5), None),
                                                         ("flex", (140, 260, 3), None), ("flex", (140, 260, 3), 64)])
def test_packed_documents_do_not_see_each_other(tiny_model_dir, attention, lengths, mask_tile):
    """The target stage gives a document the same features packed with others as alone (flex:
    in the BlockMask's tiles for the CPU, 128, and in Hopper's, 64)."""
    replicas, _, _ = tp.load_target_replicas(tiny_model_dir, [torch.device("cpu")], [1, 3], log=lambda *a: None,
                                             target_attention=attention)
    rep = replicas[0]
    if mask_tile:
        rep.mask_tile = mask_tile
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 100, (n,), generator=g) for n in lengths]
    ids = torch.cat(docs + [torch.zeros(4, dtype=torch.long)])[None]
    doc_ids = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)] + [torch.full((4,), -1)])[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs] + [torch.zeros(4, dtype=torch.long)])[None]
    packed = rep.target_hidden({"input_ids": ids, "doc_ids": doc_ids, "position_ids": pos})
    at = 0
    for d in docs:
        alone = rep.target_hidden({"input_ids": d[None], "doc_ids": torch.zeros(1, len(d), dtype=torch.long),
                              "position_ids": torch.arange(len(d))[None]})
        torch.testing.assert_close(packed[0, at:at + len(d)], alone[0], rtol=1e-4, atol=1e-4)
        at += len(d)
    assert torch.isfinite(packed).all()


def test_target_stage_block_mask_takes_the_flex_kernel_tiles_for_the_card(monkeypatch):
    """On Hopper at head_dim 128 the stage's flex kernel runs 64 x 64 tiles (target_model.SM90_FLEX_TARGET)
    and its document BlockMask comes in tiles of 64; elsewhere flex's default, 128."""
    from conftest import tiny_target
    doc_ids = torch.zeros(2, 300, dtype=torch.long)
    for hopper, hidden, tile in ((True, 512, 64), (True, 256, 128), (False, 512, 128)):
        monkeypatch.setattr(target_model, "hopper", lambda device, on=hopper: on)
        model = tiny_target(hidden=hidden, layers=2)  # qwen3: head_dim hidden / 4
        replica = tp.TargetReplica(model, [1], torch.device("cpu"), "flex")
        assert replica.mask_tile == tile and replica.mask(doc_ids).BLOCK_SIZE == (tile, tile), (hopper, hidden)
    assert dm.flex_mask_tile(None) == dm.flex_mask_tile({"USE_TMA": True}) == 128
    assert dm.flex_mask_tile({"BLOCK_M": 128, "BLOCK_N": 64}) == 128 and dm.flex_mask_tile(target_model.SM90_FLEX_TARGET) == 64


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
    steps = tp.checkpoint_steps(str(tmp_path / "out"))
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
    assert tp.checkpoint_steps(str(tmp_path / "o")) == [3]  # nothing saved from step 5 on
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
    error = tp.budget_error(stage, "cuda:0", settings, warm, lambda: None, lambda: None)
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
        tp.warm_up_target([replica], args, print)
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
    from conftest import tiny_target
    # config.patch restores both settings after the test (monkeypatch's undo deleted them from
    # dynamo's config module, and every later compile in the process failed)
    with torch._dynamo.config.patch(recompile_limit=8, fail_on_recompile_limit_hit=False):
        target = tiny_target(dtype=torch.float32)
        drafter = dm.DFlashDraftModel(dm.make_drafter_config(target.config, mask_token_id=1, num_draft_layers=1,
                                                             block_size=4))
        args = tp.Settings.of_flags(["--max-length", "64", "--token-budget", "128", "--num-anchors", "8", "--compile"],
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
    from conftest import tiny_target
    torch._dynamo.reset()
    target = tiny_target(dtype=torch.float32)
    drafter = dm.DFlashDraftModel(dm.make_drafter_config(target.config, mask_token_id=1, num_draft_layers=2,
                                                         block_size=4)).attach_target(target)
    args = tp.Settings.of_flags(["--max-length", "48", "--token-budget", "96", "--num-anchors", "6"]
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


def spy_on_batches(monkeypatch):
    """The batches the run is fed, in order (a hash of each batch's ids)."""
    seen = []
    real = tp.BatchSequence.iterate

    def iterate(self, *a, **k):
        for epoch, batch in real(self, *a, **k):
            seen.append(hash(batch["input_ids"].numpy().tobytes()))
            yield epoch, batch
    monkeypatch.setattr(tp.BatchSequence, "iterate", iterate)
    return seen


def test_resume_with_another_worker_count_continues_the_same_batches(tmp_path, tiny_model_dir, monkeypatch, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(40))
    seen = spy_on_batches(monkeypatch)
    common = ["--num-draft-layers", "1", "--max-steps", "6", "--log-interval", "1", "--save-interval", "3",
              "--target-gpus", "cpu"]
    assert tp.main(pipeline_args(tmp_path / "full", tiny_model_dir, data, *common, "--drafter-gpus", "cpu,cpu")) == 0
    full = list(seen)
    assert len(full) == 12
    seen.clear()
    part = pipeline_args(tmp_path / "part", tiny_model_dir, data, *common, "--drafter-gpus", "cpu,cpu")
    with monkeypatch.context() as m:
        m.setattr(tp.DrafterWorker, "train_step", faulty_train_step(5))
        assert tp.main(part) == 1
    assert tp.checkpoint_steps(str(tmp_path / "part")) == [3]
    seen.clear()
    capsys.readouterr()
    # one worker now: the rest of the schedule's 12 batches, one a step, from the recorded cursor
    assert tp.main(part + ["--drafter-gpus", "cpu", "--resume", "auto"]) == 0
    assert seen == full[6:]
    out = capsys.readouterr().out
    assert "1 drafter workers now, 2 when the checkpoint was made: continuing from batch 6" in out
    assert "done: 9 steps" in out
    # a defining setting changed: refused, the difference named
    assert tp.main(part + ["--drafter-gpus", "cpu", "--resume", "auto", "--token-budget", "384"]) == 2
    err = capsys.readouterr().err
    assert "token_budget 256 -> 384" in err and "--resume-anyway" in err
    # another validation split trains on other documents: refused too
    assert tp.main(part + ["--drafter-gpus", "cpu", "--resume", "auto", "--val-fraction", "0.2"]) == 2
    assert "training_documents" in capsys.readouterr().err
    # a longer run: continues, and says how the schedule changed
    assert tp.main(part + ["--drafter-gpus", "cpu", "--resume", "auto", "--max-steps", "20"]) == 0
    out = capsys.readouterr().out
    assert "resume: schedule changed" in out and "12 -> 20 batches in all" in out and "done: 17 steps" in out


def test_resume_auto_passes_over_an_unreadable_checkpoint(tmp_path, tiny_model_dir, monkeypatch, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(40))
    args = pipeline_args(tmp_path / "o", tiny_model_dir, data, "--num-draft-layers", "1", "--max-steps", "6",
                         "--save-interval", "2", "--target-gpus", "cpu", "--drafter-gpus", "cpu")
    with monkeypatch.context() as m:
        m.setattr(tp.DrafterWorker, "train_step", faulty_train_step(5))
        assert tp.main(args) == 1
    assert tp.checkpoint_steps(str(tmp_path / "o")) == [2, 4]
    newest = tmp_path / "o" / "checkpoints" / "step_4" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])  # cut off, as a full disk would leave it
    capsys.readouterr()
    assert tp.main(args + ["--resume", "auto"]) == 0
    out = capsys.readouterr().out
    assert "step_4 cannot be read" in out and "step_2 at step 2" in out


def test_resumed_run_stopped_before_its_first_step_saves_nothing(tmp_path, tiny_model_dir, monkeypatch, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(40))
    args = pipeline_args(tmp_path / "o", tiny_model_dir, data, "--num-draft-layers", "1", "--max-steps", "6",
                         "--save-interval", "2", "--target-gpus", "cpu", "--drafter-gpus", "cpu")
    with monkeypatch.context() as m:
        m.setattr(tp.DrafterWorker, "train_step", faulty_train_step(3))
        assert tp.main(args) == 1
    before = sorted(os.listdir(tmp_path / "o" / "checkpoints"))
    # the run is stopped (a signal, say) before any batch is fed
    monkeypatch.setattr(tp, "feed", lambda run, replicas: [tp.put(run, w, None) for w in run.workers])
    assert tp.main(args + ["--resume", "auto"]) == 0
    assert sorted(os.listdir(tmp_path / "o" / "checkpoints")) == before == ["step_2"]
    assert not os.path.exists(tmp_path / "o" / "final")
    assert "stopped before step 3; nothing saved" in capsys.readouterr().out


def test_typed_flags_win_over_the_demo_values():
    argv = ["--num-draft-layers", "5", "--lr", "6e-4"]  # equal to the defaults, typed all the same
    args = tp.parse_flags(argv)
    assert args.num_draft_layers == 5 and args.lr == 6e-4
    assert args.max_length == tp.DEMO_DEFAULTS["max_length"]  # not typed: the demo's


def test_the_gpu_demo_trains_on_regenerated_data_unless_data_is_typed(monkeypatch, tmp_path):
    """On a GPU the demo trains on the target's own answers; `--data builtin:sharegpt` typed (the
    default's value) still means the human replies. The regenerated set needs the built-in
    target on a GPU: elsewhere a clear error."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert tp.parse_flags([]).data == [demo_assets.BUILTIN_REGENERATED]
    assert tp.parse_flags(["--data", demo_assets.BUILTIN_DATA]).data == [demo_assets.BUILTIN_DATA]
    args = tp.parse_flags([])
    assert args.decay_ratio == 0.2 and args.max_steps == 6000  # the peak held, decayed over the last 1,200
    assert args.loss_decay_gamma == 3.0
    argv = ["--decay-ratio", "1.0", "--loss-decay-gamma", "7"]  # typed: the cosine over every step, the published gamma
    typed = tp.parse_flags(argv)
    assert typed.decay_ratio == 1.0 and typed.loss_decay_gamma == 7.0
    monkeypatch.undo()
    assert tp.main(["--data", demo_assets.BUILTIN_REGENERATED, "--output-dir", str(tmp_path / "o")]) == 2


def test_the_gpu_demo_regenerates_regen_batch_size_rows_at_a_time(monkeypatch, tmp_path):
    seen = []

    class Backend:  # stands in for the target (the GPU path), recording what it was asked to batch
        def __init__(self, target_name, devices, tokenizer, args, progress=None):
            seen.append((args.batch_size, args.max_new_tokens, args.max_context_tokens))

    def regenerate(input_path, output, make_backend, log, desc):
        make_backend(None)
        os.makedirs(os.path.dirname(output), exist_ok=True)
        open(output, "w").close()
        return {"text": "regenerated"}
    monkeypatch.setattr(demo_assets, "CACHE", str(tmp_path))
    monkeypatch.setattr(demo_assets, "builtin_prompts_file", lambda: str(tmp_path / "prompts.jsonl"))
    monkeypatch.setattr(regeneration, "load_tokenizer", lambda name: None)
    monkeypatch.setattr(regeneration, "EmbeddedBackend", Backend)
    monkeypatch.setattr(regeneration, "regenerate", regenerate)
    args = tp.Settings.of_flags(["--regen-batch-size", "96", "--regen-max-new-tokens", "64"])
    out = regeneration.regenerated_builtin_data(args, print)
    assert seen == [(96, 64, args.max_length)] and os.path.exists(out + ".done")
    assert regeneration.regenerated_builtin_data(args, print) == out and len(seen) == 1  # cached: not again
    with pytest.raises(chat_data.UsageError, match="--regen-batch-size 0 must be positive"):
        tp.check_flags(tp.build_parser().parse_args(["--regen-batch-size", "0"]))


def test_a_grad_clip_of_zero_is_refused():
    # It would scale every update to nothing (the clip divides by norm / clip on CUDA).
    with pytest.raises(chat_data.UsageError, match="--grad-clip 0.0 must be positive"):
        tp.check_flags(tp.build_parser().parse_args(["--grad-clip", "0"]))


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


def test_split_validation_is_disjoint_deterministic_and_sized():
    import numpy as np
    corpus = chat_data.Corpus(np.arange(30, dtype=np.int32), np.ones(30, np.uint8), np.arange(0, 31, 3), None)
    train, held = tp.split_validation(corpus, 0.2, seed=1)
    assert len(held) == 2 and len(train) == 8 and not set(train) & set(held)
    assert [a.tolist() for a in tp.split_validation(corpus, 0.2, seed=1)] == [train.tolist(), held.tolist()]
    sub = corpus.subset(held)
    assert [sub.doc(i)[0].tolist() for i in range(len(sub))] == [corpus.doc(d)[0].tolist() for d in held]
    assert len(tp.split_validation(corpus, 0.01, seed=1)[1]) == 0  # too few documents to hold any out
    # documents opening with the same prompt (tokens before the first trained one) stay together
    ids = np.array([7, 8, 1, 2] * 40 + [int(i) for i in range(100, 120)], dtype=np.int32)  # 40 copies, then 5 others
    mask = np.array([0, 0, 1, 1] * 45, dtype=np.uint8)
    corpus = chat_data.Corpus(ids, mask, np.arange(0, 181, 4), None)
    for seed in range(20):
        train, held = tp.split_validation(corpus, 0.1, seed)
        copies = set(range(40))
        assert not set(train) & set(held) and len(train) + len(held) == 45
        assert copies <= set(held) or not copies & set(held), seed  # all 40 copies on one side
        assert len(held) >= 4


def test_split_validation_keeps_its_prompts_when_the_data_is_regenerated():
    """Regenerated data has the same prompts with other answers, and so other document counts
    and indices: the held-out prompts stay the same (the figures of two runs compare)."""
    import numpy as np
    rng = np.random.default_rng(0)

    def corpus_of(docs):  # docs: (prompt tokens, answer tokens)
        ids = np.concatenate([np.concatenate([p, a]) for p, a in docs]).astype(np.int32)
        mask = np.concatenate([np.r_[np.zeros(len(p)), np.ones(len(a))] for p, a in docs]).astype(np.uint8)
        return chat_data.Corpus(ids, mask, np.cumsum([0] + [len(p) + len(a) for p, a in docs]), None)
    prompts = [rng.integers(10, 1000, 6) for _ in range(300)]
    first = [(p, rng.integers(10, 1000, rng.integers(3, 9))) for p in prompts]
    # regenerated: other answers, 6 conversations now split in two documents, 4 new ones at the front
    second = [(rng.integers(10, 1000, 6), rng.integers(10, 1000, 5)) for _ in range(4)]
    for i, p in enumerate(prompts):
        second += [(p, rng.integers(10, 1000, 4))] * (2 if i % 50 == 0 else 1)
    held = []
    for docs in (first, second):
        _, h = tp.split_validation(corpus_of(docs), 0.05, seed=3)
        held.append({docs[i][0].tobytes() for i in h})
    assert len(held[0]) >= 15 and len(held[0] ^ held[1]) <= 4  # a new prompt may take a place at the edge
def test_split_advice_names_the_bound_stage_and_the_fastest_split():
    """The issue's figures: Qwen3-8B shapes, 4 x 3072 tokens, target forward 427 ms and drafter
    step 518 ms on an H200. 6+2 is drafter-bound at 2 x 12288 / 0.518 = 47.4K tokens/s; of 8 GPUs
    4+4 is fastest (min(4 x 28.8K, 4 x 23.7K) = 94.9K)."""
    gpu = lambda *i: [torch.device("cuda", k) for k in i]
    a = tp.split_advice(0.427, 0.518, gpu(0, 1, 2, 3, 4, 5), gpu(6, 7), 12288)
    assert a["bound"] == "drafter"
    assert a["expected_tokens_per_s"] == pytest.approx(2 * 12288 / 0.518)
    assert a["best"][:2] == (4, 4) and a["best"][2] == pytest.approx(4 * 12288 / 0.518)
    assert a["flags"] == "--target-gpus 0,1,2,3 --drafter-gpus 4,5,6,7"
    assert "drafter-bound" in a["line"] and "4+4" in a["line"] and a["flags"] in a["line"]
    # a fast drafter: the target bounds 1+1, and 1+1 is already the best split of two GPUs
    b = tp.split_advice(0.4, 0.1, gpu(0), gpu(1), 12288)
    assert b["bound"] == "target" and b["best"][:2] == (1, 1) and b["flags"] is None
    assert b["expected_tokens_per_s"] == pytest.approx(12288 / 0.4)
    # one device shared: times taken beside each other, the stages overlapping, the slower bounds
    c = tp.split_advice(0.2, 0.3, gpu(0), gpu(0), 1000)
    assert c["bound"] == "shared" and c["expected_tokens_per_s"] == pytest.approx(1000 / 0.3)


def test_compiled_target_layers_give_the_same_features(tiny_model_dir):
    """--compile-target: the target's decoder layers compiled by inductor (flex path) give the
    uncompiled layers' features on a packed batch."""
    (plain,), _, _ = tp.load_target_replicas(tiny_model_dir, [torch.device("cpu")], [1, 3], log=lambda *a: None,
                                             target_attention="flex")
    (fused,), _, _ = tp.load_target_replicas(tiny_model_dir, [torch.device("cpu")], [1, 3], log=lambda *a: None,
                                             target_attention="flex", compile_layers=True)
    g = torch.Generator().manual_seed(0)
    doc = torch.tensor([[0] * 90 + [1] * 150 + [2] * 60])
    pos = torch.cat([torch.arange(90), torch.arange(150), torch.arange(60)])[None]
    batch = {"input_ids": torch.randint(0, 100, (1, 300), generator=g), "doc_ids": doc, "position_ids": pos}
    assert all(getattr(layer, "_compiled_call_impl", None) is not None for layer in target_model.decoder_layers(fused.model))
    torch.testing.assert_close(fused.target_hidden(batch), plain.target_hidden(batch), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch,config", [("qwen3", {}), ("llama", {"mlp_bias": True})])
def test_target_stage_stacks_gate_and_up_into_one_matmul_with_the_transformers_features(arch, config):
    """The target stage's MLPs (GateUpMLP): compiled, the gate and up projections are one matmul
    (two in the MLP, down included); eager, the MLP's own output to the bit; the features, eager
    and with the layers compiled, are the transformers forward's hidden states."""
    from conftest import tiny_target
    from torch._inductor.utils import run_and_get_code
    target = tiny_target(arch=arch, layers=4, dtype=torch.float32, init_std=0.15, **config)
    replica = tp.TargetReplica(copy.deepcopy(target), [1, 2], torch.device("cpu"), "flex")
    assert [type(layer.mlp) for layer in target_model.decoder_layers(replica.model)] == [tp.GateUpMLP] * 4
    assert (target_model.decoder_layers(replica.model)[0].mlp.bias is not None) == bool(config)
    ids = torch.randint(0, 300, (1, 200), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "doc_ids": torch.zeros(1, 200, dtype=torch.long), "position_ids": torch.arange(200)[None]}
    hidden = target(ids, output_hidden_states=True).hidden_states
    expected = torch.cat([hidden[2], hidden[3]], dim=-1)
    torch.testing.assert_close(replica.target_hidden(batch), expected, rtol=1e-5, atol=1e-5)

    x = torch.randn(3, 50, 64, generator=torch.Generator().manual_seed(1))
    mlp = target_model.decoder_layers(replica.model)[1].mlp
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        out, (code,) = run_and_get_code(torch.compile(mlp, dynamic=False), x)
    assert code.count("extern_kernels.mm(") + code.count("extern_kernels.addmm(") == 2
    with torch.no_grad():
        own = target.model.layers[1].mlp(x)
        torch.testing.assert_close(out, own, rtol=1e-5, atol=1e-5)
        assert torch.equal(mlp(x), own)

    torch._dynamo.reset()
    replica.set_compiled_layers(True)
    torch.testing.assert_close(replica.target_hidden(batch), expected, rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()


def test_mlps_of_another_form_are_not_stacked():
    """stack_gate_up leaves alone an MLP whose forward is not down(act(gate(x)) * up(x)), or that
    has more than those four parts."""
    from conftest import tiny_target

    class UpGated(torch.nn.Module):  # the gate and up roles swapped
        def __init__(self, mlp):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj, self.act_fn = mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn

        def forward(self, x):
            return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))

    target = tiny_target(layers=3, dtype=torch.float32, init_std=0.15)
    layers = target_model.decoder_layers(target)
    layers[0].mlp = UpGated(layers[0].mlp)
    layers[1].mlp.dropout = torch.nn.Dropout(0.0)
    assert tp.stack_gate_up(target) == 1
    assert [type(layer.mlp).__name__ for layer in layers] == ["UpGated", "Qwen3MLP", "GateUpMLP"]


def test_compiled_target_layers_store_queries_token_major_and_save_the_attention_output_copy(tiny_model_dir,
                                                                                             monkeypatch):
    """flex's output follows its queries' order: with the queries token-major (target_model.token_major) a
    compiled layer has one kernel fewer than with inductor's own order, which needs a transposing
    copy before the output projection; the features are the same."""
    from torch._inductor import metrics
    from torch._inductor.utils import run_and_get_code
    batch = {"input_ids": torch.randint(0, 100, (2, 256), generator=torch.Generator().manual_seed(0)),
             "doc_ids": torch.tensor([[0] * 100 + [1] * 156, [0] * 256]), "position_ids": torch.arange(256).repeat(2, 1)}

    def features_and_kernels_a_layer():
        torch._dynamo.reset()
        metrics.reset()
        (replica,), _, _ = tp.load_target_replicas(tiny_model_dir, [torch.device("cpu")], [1, 3], log=lambda *a: None,
                                                   target_attention="flex", compile_layers=True)
        # No FX graph cache, so each call compiles what it counts (config.patch: monkeypatch's undo
        # deletes a config entry); run_and_get_code returns one code a compiled graph.
        with torch._inductor.config.patch(fx_graph_cache=False):
            target_hidden, codes = run_and_get_code(replica.target_hidden, batch)
        return target_hidden, metrics.generated_kernel_count / len(codes)

    token_major = features_and_kernels_a_layer()
    monkeypatch.setattr(target_model, "token_major", lambda query: query)
    inductors_order = features_and_kernels_a_layer()
    torch._dynamo.reset()
    torch.testing.assert_close(token_major[0], inductors_order[0], rtol=1e-4, atol=1e-4)
    assert token_major[1] == inductors_order[1] - 1


def test_the_built_in_target_is_evaluated_on_mt_bench_whatever_it_trains_on(tmp_path):
    """The final evaluation of the built-in target defaults to MT-Bench with any --data (the
    human-reply comparison run typed a file and was evaluated on nothing); --eval-data wins; any
    other target has no default."""
    parser = tp.build_parser()
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


def test_target_stage_defaults_to_flex_compiled_on_gpus_and_typed_flags_win():
    parser = tp.build_parser()
    gpu, cpu = [torch.device("cuda", 0)], [torch.device("cpu")]
    opts = lambda argv, devices: tp.resolve_target_stage(parser.parse_args(argv), devices)  # noqa: E731
    assert opts([], cpu) == ("dense", False) and opts(["--compile"], cpu) == ("dense", False)
    assert opts([], gpu) == ("flex", False) and opts(["--compile"], gpu) == ("flex", True)
    assert opts(["--compile", "--target-attention", "dense", "--no-compile-target"], gpu) == ("dense", False)
    assert opts(["--target-attention", "flex", "--compile-target"], cpu) == ("flex", True)


def test_decay_ratio_holds_the_peak_then_decays_to_zero():
    args = types.SimpleNamespace(max_steps=100, epochs=None, warmup_ratio=0.1, decay_ratio=0.2)
    schedule = tp.planned_schedule(args, batches_per_epoch=7, num_workers=2)
    assert schedule == {"total_batches": 200, "warmup_batches": 20, "decay_batches": 40}
    lr = [tp.scheduled_lr(b, schedule, 1.0) for b in range(201)]
    assert lr[10] == pytest.approx(0.5) and lr[20] == 1.0
    assert all(x == 1.0 for x in lr[20:161])                  # held until the last 20% of steps
    assert lr[180] == pytest.approx(0.5) and lr[200] == pytest.approx(0.0)
    assert all(a > b for a, b in zip(lr[160:200], lr[161:201]))
    # 1.0 (the default) is cosine over everything after the warm-up, as a schedule recorded
    # before the flag (no decay_batches) is read
    full = tp.planned_schedule(types.SimpleNamespace(**{**vars(args), "decay_ratio": 1.0}), 7, 2)
    assert full["decay_batches"] == 180
    old = {k: full[k] for k in ("total_batches", "warmup_batches")}
    for b in (0, 20, 21, 110, 199, 200):
        expect = b / 20 if b <= 20 else 0.5 * (1 + math.cos(math.pi * (b - 20) / 180))
        assert tp.scheduled_lr(b, full, 1.0) == pytest.approx(expect) == tp.scheduled_lr(b, old, 1.0)


def test_checkpoint_from_before_decay_ratio_resumes_its_recorded_schedule():
    args = types.SimpleNamespace(max_steps=100, epochs=None, warmup_ratio=0.1, decay_ratio=1.0, resume_anyway=False)
    recorded = {"total_batches": 100, "warmup_batches": 10}  # as a checkpoint made before --decay-ratio records it
    state = {"step": 40, "consumed_batches": 40, "num_workers": 1, "settings": {}, "schedule": recorded,
             "length_flags": {"max_steps": 100, "epochs": None, "warmup_ratio": 0.1}}
    said = []
    plan = tp.plan_run(args, {}, types.SimpleNamespace(batches_per_epoch=7), 1, state, said.append)
    assert plan.schedule is recorded and not any("schedule changed" in s for s in said), said
    # asking for another decay now is a changed schedule, replanned and said so
    said.clear()
    plan = tp.plan_run(types.SimpleNamespace(**{**vars(args), "decay_ratio": 0.2}), {}, types.SimpleNamespace(batches_per_epoch=7),
                       1, state, said.append)
    assert plan.schedule["decay_batches"] == 20 and any("schedule changed" in s for s in said), said


def test_drafter_attention_auto_is_sdpa_on_cpu_and_triton_refused(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    settings = tp.resolve_settings(tp.build_parser().parse_args(["--target-model", tiny_model_dir]))
    assert settings.drafter_attention == "sdpa"
    settings = tp.resolve_settings(tp.build_parser().parse_args(["--target-model", tiny_model_dir,
                                                                  "--drafter-attention", "flex"]))
    assert settings.drafter_attention == "flex"
    with pytest.raises(chat_data.UsageError, match="--drafter-attention triton needs CUDA"):
        tp.resolve_settings(tp.build_parser().parse_args(["--target-model", tiny_model_dir, "--drafter-attention", "triton"]))


def test_drafter_attention_auto_is_triton_on_hopper_gpus_where_its_shapes_fit(monkeypatch):
    monkeypatch.setattr(dm, "triton", object())  # installed or not here: the choice is what is tested
    capability = {"cuda:0": (9, 0), "cuda:1": (9, 0)}
    monkeypatch.setattr(dm, "cuda_capability", lambda device: capability[device])
    parser = tp.build_parser()
    gpu, cpu = [torch.device("cuda", 0)], [torch.device("cpu")]
    qwen3_8b = types.SimpleNamespace(num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_size=4096)
    def choose(argv, devices, tc=qwen3_8b):
        args = parser.parse_args(argv)
        return tp.resolve_drafter_attention(args.drafter_attention, devices, tc, args.block_size)
    assert choose([], gpu) == "triton" and choose([], cpu) == "sdpa"
    assert choose(["--drafter-attention", "flex"], gpu) == "flex"
    # past what the kernels were measured on: 256-wide heads (Gemma 3), 4 query heads x 64 slots
    # (256 rows) per KV head, a head_dim not a power of two; auto takes flex there, triton is refused
    wide = types.SimpleNamespace(num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_size=2048)
    no_head_dim = types.SimpleNamespace(num_attention_heads=12, num_key_value_heads=4, hidden_size=1152)  # 96
    for argv, tc in (([], wide), (["--block-size", "64"], qwen3_8b), ([], no_head_dim)):
        assert choose(argv, gpu, tc) == "flex"
        with pytest.raises(chat_data.UsageError, match="--drafter-attention triton needs"):
            choose(argv + ["--drafter-attention", "triton"], gpu, tc)
    assert choose(["--block-size", "32"], gpu) == "triton"  # 4 x 32: 128 rows
    # its settings were chosen on an H200: on other GPUs (or any drafter GPU not Hopper) auto
    # takes flex, and triton is still there when asked for
    two = [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert choose([], two) == "triton"
    capability["cuda:1"] = (8, 0)
    assert choose([], two) == "flex" and choose(["--drafter-attention", "triton"], two) == "triton"
    monkeypatch.setattr(dm, "triton", None)
    assert choose([], gpu) == "flex"


FLAT_ADAMW_CHECK = """
import sys, copy, torch
sys.path.insert(0, sys.argv[1])
import flat_adamw as fa
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


def test_settings_are_resolved_once_and_frozen(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    flags = tp.build_parser().parse_args(["--target-model", tiny_model_dir, "--max-length", "100",
                                          "--token-budget", "250", "--num-anchors", "8", "--num-draft-layers", "2"])
    before = dict(vars(flags))
    settings = tp.resolve_settings(flags)
    assert vars(flags) == before  # the flags are read, never changed
    assert settings.token_budget == 200 and settings.rows_per_batch == 2
    layers = json.load(open(os.path.join(tiny_model_dir, "config.json")))["num_hidden_layers"]
    assert settings.target_layer_ids == dm.default_target_layer_ids(layers, 2) and settings.drafter_attention == "sdpa"
    assert settings.target_devices == [torch.device("cpu")] and settings.chat_template_kwargs == {}
    assert settings.loss_decay_gamma == dm.default_loss_gamma(16)
    with pytest.raises(AttributeError, match="frozen"):
        settings.lr = 1.0
    changed = settings.replace(lr=1.0)
    assert changed.lr == 1.0 and settings.lr == 6e-4
    # a setting that cannot be read is a sentence naming the flag, not a traceback
    with pytest.raises(chat_data.UsageError, match="--target-layer-ids a,b"):
        tp.resolve_settings(tp.build_parser().parse_args(["--target-model", tiny_model_dir, "--target-layer-ids", "a,b"]))


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


def test_init_drafter_starts_from_a_drafter_that_fits_and_names_what_does_not(tmp_path, tiny_model_dir, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(40))
    small = ["--target-gpus", "cpu", "--drafter-gpus", "cpu", "--num-draft-layers", "1", "--max-steps", "2"]
    assert tp.main(pipeline_args(tmp_path / "a", tiny_model_dir, data, *small)) == 0
    released = tmp_path / "a" / "final"
    settings = tp.resolve_settings(tp.parse_flags(pipeline_args(tmp_path / "b", tiny_model_dir, data, *small,
                                                                "--init-drafter", str(released))))
    trainer = tp.Trainer(settings)
    assert trainer.load_data()
    trainer.load_models()
    from safetensors.torch import load_file
    want = load_file(released / "model.safetensors")
    got = trainer.drafters[0].state_dict()
    assert all(torch.equal(got[k].float(), want[k].float()) for k in want)  # bf16 on disk, exactly representable
    trainer.close()
    # a drafter of another shape: refused before any model loads, each difference and its flag named
    capsys.readouterr()
    assert tp.main(pipeline_args(tmp_path / "c", tiny_model_dir, data, *small, "--block-size", "8",
                                 "--num-draft-layers", "2", "--init-drafter", str(released))) == 2
    err = capsys.readouterr().err
    assert "num_draft_layers 1 (here 2: pass --num-draft-layers 1)" in err and "block_size 4 (here 8" in err
    assert tp.main(pipeline_args(tmp_path / "a", tiny_model_dir, data, *small, "--init-drafter", str(released),
                                 "--resume", "auto")) == 2


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
    assert steps and all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in steps)
    recorded = dm.read_training_record(tmp_path / "o" / "final")
    assert recorded["distillation"] == {"kl_weight": 0.25, "temperature": 2.0, "top_k": 16}
    # Another loss is another run: resuming it under --loss ce is refused, naming the difference
    capsys.readouterr()
    assert tp.main(args[:-8] + ["--max-steps", "6", "--resume", "auto"]) == 2
    assert "distillation {'kl_weight': 0.25" in capsys.readouterr().err


def llama_70b_config(path):
    """Llama-3.3-70B's shapes (the config alone: nothing downloaded, no weights)."""
    from transformers import LlamaConfig
    config = LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                         num_attention_heads=64, num_key_value_heads=8, rope_theta=500000.0,
                         tie_word_embeddings=False)
    config.save_pretrained(path)
    return config


def test_the_memory_plan_of_a_70b_target_on_a_laptop(tmp_path, capsys):
    """--plan --gpu-memory plans an 8-GPU host from the config alone: the weights are counted by
    hand here (Llama layers, the DFlash drafter's), bf16 for the target, 16 bytes a drafter
    parameter (fp32 master, bf16 copy and gradient, two fp32 moments)."""
    config = llama_70b_config(tmp_path / "l70")
    argv = ["--target-model", str(tmp_path / "l70"), "--target-gpus", "0,1,2,3,4,5", "--drafter-gpus", "6,7",
            "--gpu-memory", "80", "--plan"]
    assert tp.main(argv) == 0
    out = capsys.readouterr().out
    H, I, V, kv = 8192, 28672, 128256, 8 * 128
    layer = 2 * H * H + 2 * H * kv + 3 * H * I + 2 * H  # q, o; k, v; the MLP; two norms
    layers = dm.default_target_layer_ids(80, 5)
    target_gb = 2 * ((max(layers) + 1) * layer + V * H + H) / 2**30  # + embedding, final norm (the LM head: host)
    draft_layer = layer + 2 * 128  # + q_norm, k_norm
    # + fc over 5 target layers, two norms; the AdamW moments split over the two drafter workers
    # (the plan does not fit with the whole state on each): 8 + 8 / 2 bytes a parameter
    drafter_gb = 12 * (5 * draft_layer + 5 * H * H + 2 * H) / 2**30
    assert f"    target weights: {target_gb:.2f} GB" in out, out
    assert f"    drafter weights, gradient and AdamW state: {drafter_gb:.2f} GB" in out, out
    assert "--shard-optimizer on" in out
    assert out.count("DOES NOT FIT") == 8 and "cuda:7:" in out
    assert tp.main(argv + ["--no-shard-optimizer"]) == 0  # each worker the whole state: 16 bytes a parameter
    assert f"AdamW state: {drafter_gb * 16 / 12:.2f} GB" in capsys.readouterr().out
    assert config.num_hidden_layers == 80  # nothing loaded, nothing changed
    # split in three stages: two replicas, each over three GPUs, its layers cut as stage_bounds says
    assert tp.main(argv[:-1] + ["--target-stages", "3", "--plan"]) == 0
    out = capsys.readouterr().out
    bounds = tp.stage_bounds(max(layers) + 1, 3)
    stage_gb = [2 * ((b - a) * layer + H + (V * H if k == 0 else 0)) / 2**30
                for k, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    for gpu in range(6):
        block = out.split(f"cuda:{gpu}:")[1].split("cuda:")[0]
        assert f"    target weights: {stage_gb[gpu % 3]:.2f} GB" in block and "DOES NOT FIT" not in block, block


def test_an_evaluation_whose_target_fits_no_device_is_refused_before_training(tmp_path):
    """A 70B target's evaluation needs the whole target (141 GB in bf16) on one device: no 80 GB
    GPU holds it, nor this host in fp32, so the run is refused up front, naming the way out; on
    imaginary 400 GB GPUs, or without evaluation, it goes ahead."""
    llama_70b_config(tmp_path / "l70")
    config = tp.target_config(str(tmp_path / "l70"))
    settings = tp.Settings.of_flags(["--target-model", str(tmp_path / "l70"), "--gpu-memory", "80", "--eval-data",
                                     "p.jsonl", "--target-stages", "3"],
                                    target_devices=[torch.device("cuda", i) for i in range(6)],
                                    drafter_devices=[torch.device("cuda", 6), torch.device("cuda", 7)],
                                    target_layer_ids=dm.default_target_layer_ids(80, 5), target_attention="flex",
                                    shard_optimizer=True)
    H, I, V, kv = 8192, 28672, 128256, 8 * 128
    params = 80 * (2 * H * H + 2 * H * kv + 3 * H * I + 2 * H) + 2 * V * H + H  # layers, embedding, head, norm
    with pytest.raises(chat_data.UsageError, match=rf"whole target on one device, and it \({2 * params / 2**30:.0f} GB "
                       "in bf16.*--eval-prompts 0 and --eval-interval 0.*scripts/eval_acceptance.py"):
        tp.check_evaluation_fits(settings, config)
    tp.check_evaluation_fits(settings.replace(gpu_memory=400.0), config)
    tp.check_evaluation_fits(settings.replace(eval_prompts=0), config)


def test_a_layout_whose_weights_cannot_fit_is_refused_before_loading(tmp_path):
    llama_70b_config(tmp_path / "l70")
    settings = tp.Settings.of_flags(["--target-model", str(tmp_path / "l70"), "--gpu-memory", "80"],
                                    target_devices=[torch.device("cuda", 0)], drafter_devices=[torch.device("cuda", 1)],
                                    target_layer_ids=dm.default_target_layer_ids(80, 5), target_attention="flex")
    with pytest.raises(chat_data.UsageError, match="does not fit cuda:0.*target's weights do not fit: a replica split "
                       "over more GPUs \\(--target-stages 3 "):
        tp.check_memory_plan(settings, tp.target_config(str(tmp_path / "l70")))
    small = settings.replace(gpu_memory=400.0)  # an imaginary 400 GB card holds either stage
    assert set(tp.check_memory_plan(small, tp.target_config(str(tmp_path / "l70")))) == {torch.device("cuda", 0),
                                                                                      torch.device("cuda", 1)}
