"""Several machines through torch.distributed, on CPU: two processes under torchrun (gloo) stand
in for two machines, each running the whole pipeline with one drafter worker."""
import json
import os
import signal
import subprocess
import sys
import time

import torch
from safetensors.torch import load_file

from conftest import FAULT, ROOT, SCRIPT, chat_rows, pipeline_args, write_jsonl

# One intra-op thread everywhere, so a matmul sums in the same order in every process.
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def command(out, model_dir, data, processes, *extra, fault_at=None):
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]
                if processes > 1 else [sys.executable])
    program = [SCRIPT] if fault_at is None else [FAULT, str(fault_at), "train"]
    return launcher + [*program, *pipeline_args(out, model_dir, data, "--target-gpus", "cpu", *extra)]


def start(out, model_dir, data, processes, *extra, fault_at=None, **popen):
    # A session of its own, so that stop() ends the launcher and every process it started.
    return subprocess.Popen(command(out, model_dir, data, processes, *extra, fault_at=fault_at), text=True, cwd=ROOT,
                            env=ENV, start_new_session=True, **popen)


def stop(p):
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run(out, model_dir, data, processes, *extra, timeout=600, fault_at=None):
    p = start(out, model_dir, data, processes, *extra, fault_at=fault_at, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    finally:
        stop(p)
    return subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)


def losses(out):
    with open(out / "metrics.jsonl") as f:
        return {r["step"]: (r["loss"], r["tau_hat"], r["grad_norm"]) for r in map(json.loads, f)}


def test_two_machines_train_exactly_like_two_workers_in_one(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(60))
    steps = ["--max-steps", "8", "--log-interval", "2", "--save-interval", "4"]
    one, two = tmp_path / "one" / "out", tmp_path / "two" / "out"
    r = run(one, tiny_model_dir, data, 1, "--drafter-gpus", "cpu,cpu", *steps)
    assert r.returncode == 0, r.stderr
    r = run(two, tiny_model_dir, data, 2, "--drafter-gpus", "cpu", *steps)
    assert r.returncode == 0, r.stdout + r.stderr
    # Same batches, anchors and averaged gradients: the same run, to the bit.
    assert losses(one) == losses(two)
    a, b = load_file(one / "final" / "model.safetensors"), load_file(two / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # The first machine writes checkpoints and metrics; the other logs to its own file.
    assert sorted(os.listdir(two / "checkpoints")) == ["step_4", "step_8"]
    assert "machines: this is 1 of 2" in (two / "train.rank1.log").read_text()
    assert "done: 8 steps" in (two / "train.rank1.log").read_text()
    assert "2 drafter workers in all" in (two / "train.log").read_text()


def test_two_machines_resume_after_a_fault_as_if_uninterrupted(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(60))
    steps = ["--drafter-gpus", "cpu", "--max-steps", "8", "--log-interval", "1", "--save-interval", "4"]
    full, part = tmp_path / "full" / "out", tmp_path / "part" / "out"
    r = run(full, tiny_model_dir, data, 2, *steps)
    assert r.returncode == 0, r.stderr
    r = run(part, tiny_model_dir, data, 2, *steps, fault_at=6)
    assert r.returncode != 0
    assert os.listdir(part / "checkpoints") == ["step_4"]
    r = run(part, tiny_model_dir, data, 2, *steps, "--resume", "auto")
    assert r.returncode == 0, r.stderr
    lf, lp = losses(full), losses(part)
    assert all(lf[s] == lp[s] for s in range(5, 9)), (lf, lp)


def test_fault_on_one_machine_stops_every_machine(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(40))
    t0 = time.time()
    # The fault is injected in the last worker of all: the second machine's.
    r = run(tmp_path / "out", tiny_model_dir, data, 2, "--drafter-gpus", "cpu", "--max-steps", "1000",
            fault_at=3, timeout=180)
    assert r.returncode != 0
    assert "fault injected at step 3" in r.stdout + r.stderr
    assert time.time() - t0 < 180


def test_signal_on_one_machine_stops_all_after_the_same_step(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(40))
    out = tmp_path / "out"
    p = start(out, tiny_model_dir, data, 2, "--drafter-gpus", "cpu", "--max-steps", "100000", "--log-interval", "1",
              "--save-interval", "100000", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    rank1_log = out / "train.rank1.log"
    try:
        deadline = time.time() + 300
        while not (rank1_log.exists() and "step 3/" in rank1_log.read_text()):
            assert time.time() < deadline and p.poll() is None, "the run did not reach step 3"
            time.sleep(0.5)
        pid = int(rank1_log.read_text().split("(pid ")[1].split(")")[0])
        os.kill(pid, signal.SIGTERM)  # only the second machine is told to stop
        _, err = p.communicate(timeout=120)
    finally:
        stop(p)
    assert p.returncode == 0, err
    final = int((out / "train.rank1.log").read_text().split("done: ")[1].split(" steps")[0])
    assert 3 <= final < 100000
    assert f"done: {final} steps; drafter saved" in (out / "train.log").read_text()
    assert os.listdir(out / "checkpoints") == [f"step_{final}"]
    assert max(losses(out)) == final


def test_machines_that_disagree_are_refused():
    """E.g. one machine finds a checkpoint to resume from and another does not (no shared disk)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = ("import os, sys, torch; sys.path.insert(0, sys.argv[1]); import train_dflash_pipeline as tp\n"
            "from dflash_train import chat_data\n"
            "cluster = tp.Cluster.from_env([torch.device('cpu')], 60)\n"
            "try:\n    cluster.check_same('the step to resume from', [int(os.environ['RANK']) * 4])\n"
            "except chat_data.UsageError as e:\n    print('refused:', e)\n"
            "cluster.close()\n")
    env = dict(ENV, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    procs = [subprocess.Popen([sys.executable, "-c", code, ROOT], env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for out, err in outs:
        assert "refused: the machines disagree on the step to resume from: [0] on one, [4] on another" in out, err


def test_cross_machine_buffer_is_allocated_at_warm_up_and_reused():
    """The reduction buffer across machines (gradients + the stop vote) exists once prepare()
    ran (a worker's warm-up, before its token budget is tried) and every step reuses it."""
    import types
    import train_dflash_pipeline as tp
    sums = []
    cluster = types.SimpleNamespace(world_size=2, rank=0, all_reduce_=lambda t: sums.append(t.data_ptr()) or t.mul_(2))
    avg = tp.GradAverager(1, cluster)
    grad = torch.ones(10)
    avg.prepare(0, grad)
    assert avg.across.shape == (11,)
    for _ in range(2):
        avg.average(0, grad)
        assert torch.equal(grad, torch.ones(10))  # (2 machines' sum) / 2
    assert sums == [avg.across.data_ptr()] * 2 and not avg.stop_agreed
