"""The run directory and bad input, tried as a hostile or careless user would: one test per case
(the tiny CPU target)."""
import errno
import json
import os
import signal
import stat
import subprocess
import sys
import time

import pytest
import torch

import chat_data
import dflash_model as dm
import evaluation
import plots
import regeneration
import train_dflash_pipeline as tp
from conftest import counter_target, tiny_target, write_jsonl
from fault_inject import faulty_train_step
from test_pipeline import ROOT, SCRIPT, chat_rows, pipeline_args

SMALL = ["--target-gpus", "cpu", "--drafter-gpus", "cpu", "--num-draft-layers", "1", "--log-interval", "1"]


def run_main(tmp_path, tiny_model_dir, out="o", *extra):
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(40))
    return tp.main(pipeline_args(tmp_path / out, tiny_model_dir, data, *SMALL, *extra))


def steps_of(tmp_path, out="o"):
    return tp.checkpoint_steps(str(tmp_path / out))


# 1. --keep-checkpoints below 1 deleted every checkpoint
@pytest.mark.parametrize("keep", ["-1", "0"])
def test_keep_checkpoints_below_one_is_refused(tmp_path, tiny_model_dir, capsys, keep):
    assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "2", "--keep-checkpoints", keep) == 2
    assert "--keep-checkpoints" in capsys.readouterr().err and not os.path.exists(tmp_path / "o" / "checkpoints")


# 2. a fresh run into another run's directory pruned across both runs
def test_a_fresh_run_into_another_runs_directory_is_refused_unless_overwrite(tmp_path, tiny_model_dir, capsys):
    assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "4", "--save-interval", "2") == 0
    assert steps_of(tmp_path) == [2, 4]
    capsys.readouterr()
    assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "2", "--save-interval", "1") == 2
    err = capsys.readouterr().err
    assert "holds another run" in err and "checkpoints/step_2" in err and "--overwrite" in err
    assert steps_of(tmp_path) == [2, 4]  # untouched
    assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "2", "--save-interval", "1", "--overwrite") == 0
    assert steps_of(tmp_path) == [1, 2]
    with open(tmp_path / "o" / "metrics.jsonl") as f:
        assert max(json.loads(line)["step"] for line in f) == 2  # the earlier run's records are gone


def test_pruning_removes_only_this_runs_checkpoints_never_the_newest(tmp_path, tiny_model_dir):
    assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "6", "--save-interval", "1",
                    "--keep-checkpoints", "2") == 0
    assert steps_of(tmp_path) == [5, 6]
    # a checkpoint another run left (a run id of its own) is never pruned by this one
    other = tmp_path / "o" / "checkpoints" / "step_3"
    other.mkdir()
    (other / tp.RUN_RECORD).write_text(json.dumps({"run_id": "another", "step": 3}))
    assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "8", "--save-interval", "1", "--keep-checkpoints",
                    "1", "--resume", "auto") == 0
    assert steps_of(tmp_path) == [3, 8]


# 3. two runs on one output directory at once
def test_a_second_run_on_a_directory_in_use_is_refused(tmp_path, tiny_model_dir):
    lock = tp.OutputDirLock(str(tmp_path / "o"))  # another run holds it
    try:
        data = write_jsonl(tmp_path / "d.jsonl", chat_rows(40))
        r = subprocess.run([sys.executable, SCRIPT, *pipeline_args(tmp_path / "o", tiny_model_dir, data, *SMALL,
                                                                   "--max-steps", "2")],
                           capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert r.returncode == 2 and "is in use by another run" in r.stderr and f"pid {os.getpid()}" in r.stderr
        assert not os.path.exists(tmp_path / "o" / "metrics.jsonl")
    finally:
        lock.release()
    assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "2") == 0  # released: the directory is free


# 4. the output directory deleted mid-run
def test_a_vanished_output_directory_stops_the_run_with_a_checkpoint(tmp_path, tiny_model_dir, monkeypatch):
    import shutil
    real = tp.DrafterWorker.train_step

    def train_step(worker, step, batch):
        if step == 3:
            shutil.rmtree(tmp_path / "o")
        return real(worker, step, batch)
    monkeypatch.setattr(tp.DrafterWorker, "train_step", train_step)
    assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "50", "--save-interval", "100") == 1
    assert steps_of(tmp_path) == [3]  # saved into the recreated directory, then stopped


# 5. --resume auto with checkpoints none of which can be read
def test_resume_auto_with_no_readable_checkpoint_fails_naming_them(tmp_path, tiny_model_dir, capsys):
    assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "2", "--save-interval", "1") == 0
    for step in (1, 2):
        (tmp_path / "o" / "checkpoints" / f"step_{step}" / "training_state.pt").write_bytes(b"torn")
    capsys.readouterr()
    assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "4", "--resume", "auto") == 2
    err = capsys.readouterr().err
    assert "no checkpoint" in err and "can be read" in err and "step_1, step_2" in err


# 6. a blown-up run was not noticed
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


# 7. flags out of range were accepted
@pytest.mark.parametrize("flags,said", [
    (["--max-steps", "0"], "--max-steps 0 must be at least 1"),
    (["--max-steps", "-5"], "--max-steps -5 must be at least 1"),
    (["--warmup-ratio", "2"], "--warmup-ratio 2.0 must be in [0, 1)"),
    (["--val-fraction", "1.5"], "--val-fraction 1.5 must be in [0, 1)"),
    (["--target-layer-ids", "2,2"], "each layer once"),
    (["--weight-decay=-5"], "--weight-decay -5.0 must be 0 or more"),
    (["--target-layer-ids", "a,b"], "--target-layer-ids a,b"),
    (["--resume", "auto", "--overwrite"], "give one of them"),
])
def test_flags_out_of_range_are_refused_before_anything_loads(tmp_path, tiny_model_dir, capsys, flags, said):
    assert run_main(tmp_path, tiny_model_dir, "o", *flags) == 2
    assert said in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o" / "metrics.jsonl")


def test_a_target_that_does_not_exist_is_a_sentence(tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(4))
    assert tp.main(["--target-model", str(tmp_path / "nowhere"), "--data", data, "--output-dir", str(tmp_path / "o")]) == 2
    assert "no such directory" in capsys.readouterr().err


# 8. evaluation against a target the drafter was not made for
def test_evaluation_refuses_a_mismatched_target_and_says_what_it_measured(tmp_path, capsys):
    from scripts import eval_acceptance as ev
    target = tiny_target(vocab=128, dtype=torch.float32)
    tdir = tmp_path / "t"
    target.save_pretrained(tdir)
    from conftest import tiny_tokenizer
    tiny_tokenizer().save_pretrained(tdir)
    drafter = dm.DFlashDraftModel(dm.make_drafter_config(target.config, mask_token_id=5, num_draft_layers=1,
                                                         block_size=4, target_layer_ids=[1]))
    ddir = tmp_path / "d"
    drafter.save_pretrained(ddir)
    dm.write_training_record(ddir, {"target_model": str(tdir)})
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "the cat"}, {"turns": ["a dog", "and then"]}])
    # its own target: measured, the report beside the drafter says what was measured
    assert ev.main(["--target-model", str(tdir), "--drafter", str(ddir), "--prompts", prompts, "--device", "cpu",
                    "--max-new-tokens", "8"]) == 0
    report = json.loads((ddir / "eval_acceptance.json").read_text())
    assert report["target"] == str(tdir) and report["drafter"] == str(ddir)
    assert report["prompt_files"][0]["file"] == prompts and len(report["prompt_files"][0]["sha256"]) == 64
    assert report["decoding"]["max_new_tokens"] == 8 and report["decoding"]["temperature"] == 0.0
    # another vocabulary: refused before decoding, the drafter's report untouched
    other = tiny_target(vocab=140, dtype=torch.float32)
    odir = tmp_path / "other"
    other.save_pretrained(odir)
    tiny_tokenizer().save_pretrained(odir)
    before = (ddir / "eval_acceptance.json").read_text()
    capsys.readouterr()
    assert ev.main(["--target-model", str(odir), "--drafter", str(ddir), "--prompts", prompts, "--device", "cpu",
                    "--output", str(tmp_path / "r.json")]) == 2
    assert "vocab_size 128 (the target: 140)" in capsys.readouterr().err
    # a fitting target that is not the drafter's own: only where --output says
    assert ev.main(["--target-model", str(odir), "--drafter", str(ddir), "--prompts", prompts, "--device", "cpu"]) == 2
    assert "name the report's file" in capsys.readouterr().err
    assert (ddir / "eval_acceptance.json").read_text() == before
    assert evaluation.drafter_target_mismatches(drafter.config, target.config) == []


# 9. prompt rows of the wrong type were evaluated or dropped silently
def test_prompt_rows_of_the_wrong_type_are_counted_skips_with_file_and_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join([json.dumps({"turns": "abc"}), json.dumps({"prompt": None}), json.dumps({"prompt": 7}),
                               json.dumps({"prompt": ""}), json.dumps({"turns": []}), "{not json",
                               json.dumps({"prompt": "a good one", "category": "c"})]) + "\n")
    said = []
    assert evaluation.read_prompts(str(path), said.append) == [("c", ["a good one"])]
    text = "\n".join(said)
    for reason in ("turns is not a non-empty list of text", "prompt is not text", "bad JSON"):
        assert reason in text, text
    assert "p.jsonl:1" in text and "p.jsonl:6" in text
    path.write_text(json.dumps({"turns": []}) + "\n")
    with pytest.raises(ValueError, match="no usable prompt"):
        evaluation.read_prompts(str(path), said.append)


# 10. bytes that are not UTF-8 were trained as U+FFFD
def test_rows_that_are_not_utf8_are_counted_skips(tmp_path):
    from conftest import tiny_tokenizer
    good = json.dumps(chat_rows(1)[0]).encode()
    path = tmp_path / "d.jsonl"
    path.write_bytes(good + b"\n" + good.replace(b"cat", b"c\xff\xfet") + b"\n")
    docs, stats = chat_data.read_documents(str(path), tiny_tokenizer(), 128, 128)
    assert stats.skipped_rows == {"not UTF-8 text": 1} and stats.examples["not UTF-8 text"] == ["d.jsonl:2"]
    assert all(0xFFFD not in ids for ids, _ in docs)


# 11. regeneration keyed rows by line number only
def test_regeneration_with_another_input_into_the_same_output_is_refused(tmp_path):
    first = write_jsonl(tmp_path / "a.jsonl", [{"messages": [{"role": "user", "content": "hello"}]}])
    second = write_jsonl(tmp_path / "b.jsonl", [{"messages": [{"role": "user", "content": "goodbye"}]}])
    out = str(tmp_path / "out.jsonl")
    backend = lambda progress: (lambda convs: [({"content": "an answer"}, "stop", 2) for _ in convs])  # noqa: E731
    assert regeneration.regenerate(first, out, backend, log=lambda m: None)["rows"] == 1
    assert regeneration.regenerate(first, out, backend, log=lambda m: None)["rows"] == 0  # done: nothing again
    with pytest.raises(ValueError, match="written from another input"):
        regeneration.regenerate(second, out, backend, log=lambda m: None)


# 12. a full disk: a clear error, no partial temporary left, torn metrics skipped by readers
def test_a_full_disk_is_said_and_leaves_no_partial_checkpoint(tmp_path, tiny_model_dir, monkeypatch, capsys):
    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(torch, "save", no_space)
    assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "3", "--save-interval", "2") == 1
    err = capsys.readouterr().err
    assert "disk full at" in err and "bytes, " in err and "the last good checkpoint is kept" in err
    assert os.listdir(tmp_path / "o" / "checkpoints") == []  # the partial .tmp_step_2 removed


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


# 13. one badly typed row crashed the data stage
@pytest.mark.parametrize("row", [{"messages": None}, "a string", [1, 2], {"input_ids": "12", "loss_mask": [1, 1]},
                                 {"input_ids": [1, 2], "loss_mask": 5}, {"messages": ["hi"]}])
def test_a_badly_typed_row_is_a_counted_skip(tmp_path, row):
    from conftest import tiny_tokenizer
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps(chat_rows(1)[0]) + "\n")
    docs, stats = chat_data.read_documents(str(path), tiny_tokenizer(), 128, 128)
    (tmp_path / "good.jsonl").write_text(json.dumps(chat_rows(1)[0]) + "\n")
    assert docs == chat_data.read_documents(str(tmp_path / "good.jsonl"), tiny_tokenizer(), 128, 128)[0]
    assert sum(stats.skipped_rows.values()) == 1
    assert next(iter(stats.examples.values())) == ["d.jsonl:1"]


# 14. tracebacks where a sentence is due (evaluation)
@pytest.mark.parametrize("flags,said", [(["--max-new-tokens", "0"], "--max-new-tokens 0 must be at least 1"),
                                        (["--batch-size", "0"], "--batch-size 0 must be at least 1"),
                                        (["--chat-template-kwargs", "{nope"], "is not JSON")])
def test_evaluation_flags_are_sentences(tmp_path, capsys, flags, said):
    from scripts import eval_acceptance as ev
    drafter = dm.DFlashDraftModel(dm.make_drafter_config(counter_target().config, mask_token_id=5,
                                                         num_draft_layers=1, block_size=4))
    drafter.save_pretrained(tmp_path / "d")
    try:
        rc = ev.main(["--target-model", "x", "--drafter", str(tmp_path / "d"), *flags])
    except SystemExit as e:  # argparse's own error
        rc = e.code
    assert rc == 2 and said in capsys.readouterr().err


# 15. minor: safetensors' file mode; SIGINT in regeneration
def test_the_drafter_file_is_readable_as_open_would_make_it(tmp_path):
    drafter = dm.DFlashDraftModel(dm.make_drafter_config(counter_target().config, mask_token_id=5,
                                                         num_draft_layers=1, block_size=4))
    drafter.save_pretrained(tmp_path / "d")
    mode = stat.S_IMODE(os.stat(tmp_path / "d" / "model.safetensors").st_mode)
    assert mode == 0o666 & ~dm.process_umask() and mode & stat.S_IRGRP


def test_sigint_during_regeneration_stops_after_the_round_and_resumes(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(6)]
    inp, out = write_jsonl(tmp_path / "a.jsonl", rows), str(tmp_path / "out.jsonl")
    asked = []

    def backend(progress):
        def answer(convs):
            asked.append(len(convs))
            if len(asked) == 1:
                os.kill(os.getpid(), signal.SIGINT)  # arrives while the first round is under way
                time.sleep(0.1)
            return [({"content": "an answer"}, "stop", 2) for _ in convs]
        return answer
    summary = regeneration.regenerate(inp, out, backend, window=2, log=lambda m: None)
    assert summary["interrupted"] and summary["rows"] == 2 and asked == [2]
    summary = regeneration.regenerate(inp, out, backend, window=2, log=lambda m: None)
    assert not summary["interrupted"] and summary["rows"] == 4


def test_steps_redone_after_a_kill_are_recorded_once(tmp_path, tiny_model_dir, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(tp.DrafterWorker, "train_step", faulty_train_step(4))
        assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "6", "--save-interval", "2") == 1
    assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "6", "--save-interval", "2", "--resume", "auto") == 0
    with open(tmp_path / "o" / "metrics.jsonl") as f:
        steps = [r["step"] for r in map(json.loads, f) if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_a_signal_while_finishing_is_noted_not_raised():
    seen, before = [], {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with tp.signals_handled(seen.append):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
    assert seen == [signal.SIGINT]
    # the old handlers are back after (whatever they are: a process started in the background
    # by a shell without job control ignores SIGINT from the start)
    assert {s: signal.getsignal(s) for s in before} == before


@pytest.mark.parametrize("flag", ["--batch-size", "--max-new-tokens", "--window", "--concurrency"])
def test_regeneration_flags_below_one_are_refused(tmp_path, capsys, flag):
    from scripts import regenerate_data as rg
    with pytest.raises(SystemExit) as e:
        rg.main(["--target-model", "x", "--input", "in.jsonl", "--output", str(tmp_path / "o.jsonl"), flag, "0"])
    assert e.value.code == 2 and f"{flag} 0 must be at least 1" in capsys.readouterr().err
