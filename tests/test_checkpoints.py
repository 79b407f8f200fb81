"""Tests of dflash_train/checkpoints.py: a run's plan, resuming exactly, checkpoints written and pruned safely, the
output directory kept to one run, nothing read back that runs code, --init-drafter's check."""
import errno
import json
import os
import shutil
import subprocess
import sys
import types

import pytest
import torch
from safetensors.torch import load_file

import dflash_model as dm
import train_dflash_pipeline as tp
from dflash_train import checkpoints as ck
from dflash_train import command_line as cli
from conftest import ROOT, SCRIPT, SMALL, chat_rows, metrics, pipeline_args, run_cli, run_main, steps_of, write_jsonl
from fault_inject import faulty_train_step


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


def spy_on_batches(monkeypatch):
    """The batches the run feeds its workers, in order (a hash of each batch's ids)."""
    seen = []
    real = tp.put

    def put(run, worker, item):
        if item is not None:
            seen.append(hash(item["input_ids"].numpy().tobytes()))
        return real(run, worker, item)
    monkeypatch.setattr(tp, "put", put)
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
    assert ck.checkpoint_steps(str(tmp_path / "part")) == [3]
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
    assert ck.checkpoint_steps(str(tmp_path / "o")) == [2, 4]
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


def test_a_resume_keeps_its_recorded_schedule_unless_the_length_flags_change():
    args = types.SimpleNamespace(max_steps=100, epochs=None, warmup_ratio=0.1, decay_ratio=1.0, resume_anyway=False)
    recorded = {"total_batches": 100, "warmup_batches": 10, "decay_batches": 90}
    state = {"step": 40, "consumed_batches": 40, "num_workers": 1, "settings": {}, "schedule": recorded,
             "length_flags": ck.length_flags(args), "elapsed_s": 5.0, "run_id": "r"}
    said = []
    plan = ck.plan_run(args, {}, types.SimpleNamespace(batches_per_epoch=7), 1, state, said.append)
    assert plan.schedule is recorded and plan.run_id == "r" and not any("schedule changed" in s for s in said), said
    # asking for another decay now is a changed schedule, replanned and said so
    said.clear()
    plan = ck.plan_run(types.SimpleNamespace(**{**vars(args), "decay_ratio": 0.2}), {},
                       types.SimpleNamespace(batches_per_epoch=7), 1, state, said.append)
    assert plan.schedule["decay_batches"] == 20 and any("schedule changed" in s for s in said), said


def test_init_drafter_starts_from_a_drafter_that_fits_and_names_what_does_not(tmp_path, tiny_model_dir, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(40))
    small = ["--target-gpus", "cpu", "--drafter-gpus", "cpu", "--num-draft-layers", "1", "--max-steps", "2"]
    assert tp.main(pipeline_args(tmp_path / "a", tiny_model_dir, data, *small)) == 0
    released = tmp_path / "a" / "final"
    settings = cli.resolve_settings(cli.parse_flags(pipeline_args(tmp_path / "b", tiny_model_dir, data, *small,
                                                                "--init-drafter", str(released))))
    trainer = tp.Trainer(settings)
    assert trainer.load_data()
    trainer.load_models()
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


@pytest.mark.parametrize("keep", ["-1", "0"])
def test_keep_checkpoints_below_one_is_refused(tmp_path, tiny_model_dir, capsys, keep):
    assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "2", "--keep-checkpoints", keep) == 2
    assert "--keep-checkpoints" in capsys.readouterr().err and not os.path.exists(tmp_path / "o" / "checkpoints")


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
    (other / ck.RUN_RECORD).write_text(json.dumps({"run_id": "another", "step": 3}))
    assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "8", "--save-interval", "1", "--keep-checkpoints",
                    "1", "--resume", "auto") == 0
    assert steps_of(tmp_path) == [3, 8]


def test_a_second_run_on_a_directory_in_use_is_refused(tmp_path, tiny_model_dir):
    lock = ck.OutputDirLock(str(tmp_path / "o"))  # another run holds it
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


def test_resume_auto_with_no_readable_checkpoint_fails_naming_them(tmp_path, tiny_model_dir, capsys):
    assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "2", "--save-interval", "1") == 0
    for step in (1, 2):
        (tmp_path / "o" / "checkpoints" / f"step_{step}" / "training_state.pt").write_bytes(b"torn")
    capsys.readouterr()
    assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "4", "--resume", "auto") == 2
    err = capsys.readouterr().err
    assert "no checkpoint" in err and "can be read" in err and "step_1, step_2" in err


def test_a_planted_pickle_in_a_checkpoint_never_runs(tmp_path, tiny_model_dir, capsys):
    """A training_state.pt whose unpickling would run a command: --resume auto reads it with the
    weights-only unpickler, which refuses it, and resumes from the checkpoint before."""
    assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "2", "--save-interval", "1") == 0
    marker = tmp_path / "ran"

    class Planted:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    path = tmp_path / "o" / "checkpoints" / "step_2" / "training_state.pt"
    state = torch.load(path, weights_only=True)
    torch.save({**state, "planted": Planted()}, path)
    capsys.readouterr()
    assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "3", "--resume", "auto") == 0
    assert not marker.exists()
    out = capsys.readouterr().out
    assert "step_2 cannot be read" in out and "resume: " in out and "at step 1," in out, out


def test_a_checkpoint_of_another_format_is_refused_naming_its_writer(tmp_path, tiny_model_dir, capsys):
    assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "1", "--save-interval", "1") == 0
    path = tmp_path / "o" / "checkpoints" / "step_1" / "training_state.pt"
    state = torch.load(path, weights_only=True)
    assert state["format"] == ck.CHECKPOINT_FORMAT and state["written_by"] == ck.WRITTEN_BY
    torch.save({**state, "format": 1, "written_by": "dflash-train 0.1.0"}, path)
    capsys.readouterr()
    assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "3", "--resume", "auto") == 2
    err = capsys.readouterr().err
    assert "written by dflash-train 0.1.0 in format 1" in err and "--init-drafter" in err, err
    # a state that records no format: written before checkpoints recorded theirs
    torch.save({k: v for k, v in state.items() if k not in ("format", "written_by")}, path)
    assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "3", "--resume", str(path.parent)) == 2
    assert "a version before checkpoints recorded theirs in format None" in capsys.readouterr().err


def test_a_full_disk_is_said_and_leaves_no_partial_checkpoint(tmp_path, tiny_model_dir, monkeypatch, capsys):
    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(torch, "save", no_space)
    assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "3", "--save-interval", "2") == 1
    err = capsys.readouterr().err
    assert "disk full at" in err and "bytes, " in err and "the last good checkpoint is kept" in err
    assert os.listdir(tmp_path / "o" / "checkpoints") == []  # the partial .tmp_step_2 removed


def test_final_is_swapped_in_whole_and_rebuilt_by_resume_auto_where_missing(tmp_path, tiny_model_dir, monkeypatch,
                                                                             capsys):
    assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "2") == 0
    final = tmp_path / "o" / "final"
    before = {f: (final / f).read_bytes() for f in ("model.safetensors", "config.json", "dflash_training.json")}

    def killed_while_writing(self, path, dtype=None):
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "model.safetensors"), "wb") as f:
            f.write(b"torn")
        raise KeyboardInterrupt
    with monkeypatch.context() as m:
        m.setattr(dm.DFlashDraftModel, "save_pretrained", killed_while_writing)
        with pytest.raises(KeyboardInterrupt):
            ck.save_final(str(tmp_path / "o"), dm.DFlashDraftModel.from_pretrained(str(final)), {})
    assert {f: (final / f).read_bytes() for f in before} == before  # the one before, whole
    shutil.rmtree(final)
    capsys.readouterr()
    assert run_main(tmp_path, tiny_model_dir, "o", "--max-steps", "2", "--resume", "auto") == 0
    out = capsys.readouterr().out
    assert "nothing to do" in out and "final/ was missing or partial: rebuilt from" in out, out
    assert {f: (final / f).read_bytes() for f in before} == before
