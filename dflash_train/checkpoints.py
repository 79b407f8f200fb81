"""What a run starts from and leaves: its plan (fresh or resumed from a checkpoint, the schedule),
checkpoints written atomically, found and pruned, the output directory's lock, and the drafter a
run may start from (--init-drafter)."""

import dataclasses
import errno
import fcntl
import hashlib
import json
import math
import os
import shutil
import socket
import uuid

import numpy as np
import torch

import dflash_model as dm
import dflash_train
from dflash_train import helpers
from dflash_train.chat_data import UsageError
from dflash_train.evaluation import drafter_target_mismatches


def check_init_drafter(settings, mask_token_id):
    """--init-drafter's drafter against the target and these settings: hidden size, vocabulary,
    draft layers, block size, target layers, mask token (the data stage's); a UsageError naming
    each difference (with the flags that would match it), before any model loads."""
    config = dm.DFlashDraftModel.read_config(settings.init_drafter)
    dflash = config.dflash_config
    wrong = drafter_target_mismatches(config, helpers.text_config(settings.target_config))
    for name, theirs, ours, flag in (
            ("num_draft_layers", config.num_hidden_layers, settings.num_draft_layers, "--num-draft-layers"),
            ("block_size", config.block_size, settings.block_size, "--block-size"),
            ("target_layer_ids", list(dflash["target_layer_ids"]), settings.target_layer_ids, "--target-layer-ids"),
            ("mask_token_id", dflash["mask_token_id"], mask_token_id, "--mask-token-id")):
        if theirs != ours:
            value = ",".join(map(str, theirs)) if isinstance(theirs, list) else theirs
            wrong.append(f"{name} {theirs} (here {ours}: pass {flag} {value})")
    if wrong:
        raise UsageError(f"--init-drafter {settings.init_drafter} does not fit: {'; '.join(wrong)}")


def planned_schedule(settings, batches_per_epoch, num_workers):
    """{total_batches, warmup_batches, decay_batches} from --max-steps or --epochs, --warmup-ratio
    and --decay-ratio, whole steps of num_workers batches each."""
    steps = settings.max_steps or max(1, int(settings.epochs * batches_per_epoch) // num_workers)
    warmup = math.ceil(settings.warmup_ratio * steps)
    decay = min(steps - warmup, math.ceil(settings.decay_ratio * steps))
    return {"total_batches": steps * num_workers, "warmup_batches": warmup * num_workers,
            "decay_batches": decay * num_workers}


# -----------------------------------------------------------------------------
# Checkpoints: servable drafter + training state, written to a temp dir, fsynced, then renamed

# The settings that define a run: a resumed run must have the same ones (--resume-anyway aside).
# The worker count and the length of the run may change on resume (see plan_run).
# The layout of a checkpoint's training_state.pt that this version writes and reads: a checkpoint
# of another is refused, naming the version that wrote it (a drafter's weights, model.safetensors,
# can always start a new run: --init-drafter).
CHECKPOINT_FORMAT = 2
WRITTEN_BY = f"dflash-train {dflash_train.__version__}"

DEFINING_SETTINGS = ("target_model", "data_files", "data_fingerprint", "chat_template_kwargs", "token_budget",
                     "max_length", "num_anchors", "block_size", "num_draft_layers", "target_layer_ids", "mask_token_id",
                     "seed", "training_documents", "distillation")


def length_flags(settings):
    return {"max_steps": settings.max_steps, "epochs": settings.epochs, "warmup_ratio": settings.warmup_ratio,
            "decay_ratio": settings.decay_ratio}


@dataclasses.dataclass
class RunPlan:
    """Where a run starts and ends: in steps, and in batches of its BatchSequence (the cursor).
    Each step consumes num_workers batches; the learning-rate schedule is over batches."""
    start_step: int
    start_cursor: int
    num_workers: int
    schedule: dict  # planned_schedule()
    defining: dict  # defining_settings()
    length_flags: dict  # the flags the schedule was planned from (length_flags())
    start_elapsed_s: float = 0.0  # seconds of training before this process (the checkpoint's)
    # Which run this is: a fresh run draws one, a resumed run keeps its checkpoint's. Pruning
    # removes only this run's checkpoints.
    run_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:12])

    @property
    def total_steps(self):
        return self.start_step + max(0, math.ceil((self.schedule["total_batches"] - self.start_cursor)
                                                  / self.num_workers))

    def cursor_after(self, step):
        return self.start_cursor + (step - self.start_step) * self.num_workers


def defining_settings(settings, data):
    """The defining settings of a run (DEFINING_SETTINGS), as recorded in its checkpoints: the
    flags' and the data stage's (batches.TrainingData: its files, the corpus's fingerprint, the
    mask token, and the documents it trains on, the validation ones left out, as a hash)."""
    s = {k: getattr(settings, k) for k in DEFINING_SETTINGS if hasattr(settings, k)}
    s.update(data_files=[os.path.abspath(p) for p in data.files], data_fingerprint=data.corpus.fingerprint(),
             mask_token_id=data.mask_token_id,
             training_documents=hashlib.sha256(np.asarray(data.batches.docs, np.int64).tobytes()).hexdigest()[:16])
    return s


def checkpoint_steps(out_dir):
    root = os.path.join(out_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    return sorted(int(d[5:]) for d in os.listdir(root) if d.startswith("step_") and d[5:].isdigit())


def fsync_path(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class OutputDirLock:
    """An exclusive lock on --output-dir for the run's life, its holder's host and pid written in
    it: a second run on the same directory is refused at start-up instead of interleaving its
    metrics and checkpoints with the first's. The lock goes with the process (or release())."""

    def __init__(self, output_dir):
        os.makedirs(output_dir, exist_ok=True)
        self.file = open(os.path.join(output_dir, ".lock"), "a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.seek(0)
            holder = self.file.read().strip() or "another process"
            self.file.close()
            raise UsageError(f"--output-dir {output_dir} is in use by another run ({holder}); wait for it to end, or "
                             "choose another --output-dir") from None
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"host {socket.gethostname()}, pid {os.getpid()}\n")
        self.file.flush()

    def release(self):
        if not self.file.closed:
            fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()


def claim_output_dir(settings):
    """A fresh run (no --resume) into a directory holding another run's checkpoints, final/ or
    metrics is refused, naming them, unless --overwrite says to clear them first: a fresh run
    there would prune, resume from or mix with the other run's files. Returns what it cleared."""
    out = settings.output_dir
    found = [f"checkpoints/step_{s}" for s in checkpoint_steps(out)]
    found += ["final"] if os.path.exists(os.path.join(out, "final")) else []
    metrics = os.path.join(out, "metrics.jsonl")
    found += ["metrics.jsonl"] if os.path.exists(metrics) and os.path.getsize(metrics) else []
    if settings.resume or not found:
        return []
    if not settings.overwrite:
        raise UsageError(f"--output-dir {out} holds another run ({', '.join(found[:4])}"
                         f"{', ...' if len(found) > 4 else ''}): pass --resume auto to continue it, --overwrite to "
                         "replace it, or choose another --output-dir")
    for name in ("checkpoints", "final", "metrics.jsonl", "training.png", "acceptance.png"):
        path = os.path.join(out, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.path.exists(path) and os.remove(path)
    return found


RUN_RECORD = "run.json"  # in each checkpoint: which run wrote it, so pruning never touches another's


def checkpoint_run_id(out_dir, step):
    try:
        with open(os.path.join(out_dir, "checkpoints", f"step_{step}", RUN_RECORD)) as f:
            return json.load(f)["run_id"]
    except (OSError, ValueError, KeyError):
        return None


def merged_optimizer_state(workers):
    """The workers' AdamW state as one unsharded AdamW's: worker 0's, or with --shard-optimizer
    every worker's share together."""
    if not workers[0].settings.shard_optimizer:
        return workers[0].optimizer_state()
    states = [w.optimizer_state() for w in workers]
    group = {**states[0]["param_groups"][0], "params": list(range(len(workers[0].params)))}
    return {"state": {k: v for st in states for k, v in st["state"].items()}, "param_groups": [group]}


def save_checkpoint(out_dir, step, worker, plan, keep, optimizer_state, elapsed_s=0.0):
    """A kill at any point leaves the previous checkpoints intact: write to a temporary
    directory, fsync its files, then rename; prune old ones only after the new one exists, and
    only this run's (never the one just written). A full disk is said as such, the partial
    temporary directory removed."""
    root = os.path.join(out_dir, "checkpoints")
    final, tmp = os.path.join(root, f"step_{step}"), os.path.join(root, f".tmp_step_{step}")
    shutil.rmtree(tmp, ignore_errors=True)
    state = {"format": CHECKPOINT_FORMAT, "written_by": WRITTEN_BY, "step": step,
             "consumed_batches": plan.cursor_after(step), "num_workers": plan.num_workers, "schedule": plan.schedule,
             "length_flags": plan.length_flags, "settings": plan.defining, "elapsed_s": elapsed_s,
             "run_id": plan.run_id, "optimizer": optimizer_state}
    try:
        worker.drafter.save_pretrained(tmp)  # fp32 master weights, servable as is
        dm.write_training_record(tmp, plan.defining)
        with open(os.path.join(tmp, RUN_RECORD), "w") as f:
            json.dump({"run_id": plan.run_id, "step": step}, f)
        torch.save(state, os.path.join(tmp, "training_state.pt"))
        for name in os.listdir(tmp):
            fsync_path(os.path.join(tmp, name))
        fsync_path(tmp)
    except (OSError, RuntimeError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC or "No space left" in str(e):
            tensors = [t for t in worker.drafter.state_dict().values()] + \
                [t for st in state["optimizer"]["state"].values() for t in st.values() if isinstance(t, torch.Tensor)]
            need = sum(t.numel() * t.element_size() for t in tensors)
            os.makedirs(root, exist_ok=True)
            raise OSError(errno.ENOSPC, f"disk full at {root}: a checkpoint needs about {need:,} bytes, "
                          f"{shutil.disk_usage(root).free:,} are free; the last good checkpoint is kept") from None
        raise
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    fsync_path(root)
    mine = [s for s in checkpoint_steps(out_dir) if s != step and checkpoint_run_id(out_dir, s) == plan.run_id]
    for old in mine[:max(0, len(mine) - (keep - 1))]:
        shutil.rmtree(os.path.join(root, f"step_{old}"), ignore_errors=True)
    return final


def save_final(out_dir, drafter, defining):
    """The drafter to serve (bf16) with its training record in out_dir/final: written to a
    temporary directory, fsynced, then swapped in, so a kill leaves the previous final/ or the
    new one whole, never a partial one."""
    final, tmp, old = (os.path.join(out_dir, name) for name in ("final", ".tmp_final", ".old_final"))
    for path in (tmp, old):
        shutil.rmtree(path, ignore_errors=True)
    drafter.save_pretrained(tmp, dtype=torch.bfloat16)
    dm.write_training_record(tmp, defining)
    for name in os.listdir(tmp):
        fsync_path(os.path.join(tmp, name))
    fsync_path(tmp)
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_path(out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return final


def final_is_whole(out_dir):
    """Whether out_dir/final holds a drafter (its config and weights)."""
    return all(os.path.isfile(os.path.join(out_dir, "final", f)) for f in ("config.json", "model.safetensors"))


def load_checkpoint(path):
    """(weights, training state) of a checkpoint directory; raises if either cannot be read.
    Nothing in it runs code: the weights are safetensors, the state is read with torch's
    weights-only unpickler (tensors, numbers, strings and containers alone). A state of another
    format is refused, naming the version that wrote it."""
    from safetensors.torch import load_file
    state = torch.load(os.path.join(path, "training_state.pt"), map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        fmt = state.get("format") if isinstance(state, dict) else None
        by = state.get("written_by", "a version before checkpoints recorded theirs") if isinstance(state, dict) \
            else "another program"
        raise UsageError(f"checkpoint {path}: written by {by} in format {fmt}; this version ({WRITTEN_BY}) reads "
                         f"format {CHECKPOINT_FORMAT}: resume it with the version that wrote it, or start a new run "
                         f"from its drafter (--init-drafter {path})")
    weights = load_file(os.path.join(path, "model.safetensors"))
    return weights, state


def find_checkpoint(spec, out_dir, log):
    """(directory, weights, state) to resume from, or None. 'auto': the newest checkpoint in
    out_dir that can be read, saying which were passed over and why."""
    if spec != "auto":  # a checkpoint directory (check_flags saw its files)
        return (spec, *load_checkpoint(spec))
    steps = checkpoint_steps(out_dir)
    for step in reversed(steps):
        path = os.path.join(out_dir, "checkpoints", f"step_{step}")
        try:
            return (path, *load_checkpoint(path))
        except UsageError:  # readable, of another format: an older one would be too
            raise
        except Exception as e:
            log(f"resume: {path} cannot be read ({type(e).__name__}: {str(e)[:120]}); trying the one before")
    if steps:
        raise UsageError(f"--resume auto: no checkpoint in {out_dir}/checkpoints can be read "
                         f"({', '.join(f'step_{s}' for s in steps)}); name a good one with --resume DIR, or start "
                         "afresh with --overwrite")
    return None


def plan_run(settings, defining, batches, num_workers, state, log):
    """The RunPlan of a fresh run (state None) or of one resumed from a checkpoint's state.

    Resuming: every defining setting must equal the checkpoint's, or the run is refused naming
    each difference (--resume-anyway continues, and says so). Another worker count continues
    from the recorded batch cursor with the recorded schedule; another --max-steps or --epochs
    continues with a schedule planned anew, logged."""
    schedule, flags = planned_schedule(settings, batches.batches_per_epoch, num_workers), length_flags(settings)
    if state is None:
        return RunPlan(0, 0, num_workers, schedule, defining, flags)
    old = state["settings"]
    diff = [f"{k} {old.get(k)!r} -> {defining.get(k)!r}" for k in DEFINING_SETTINGS if old.get(k) != defining.get(k)]
    if diff and not settings.resume_anyway:
        raise UsageError("--resume: the checkpoint was made with other settings: " + "; ".join(diff)
                         + " (restore them, or pass --resume-anyway to continue regardless)")
    if diff:
        log("resume: continuing despite other settings (--resume-anyway): " + "; ".join(diff))
    cursor, recorded, recorded_flags = state["consumed_batches"], state["schedule"], state["length_flags"]
    if recorded_flags == flags:
        schedule = recorded
    else:
        log(f"resume: schedule changed with {flags} (was {recorded_flags}): "
            f"{recorded['total_batches']} -> {schedule['total_batches']} batches in all, warm-up "
            f"{recorded['warmup_batches']} -> {schedule['warmup_batches']}")
    if state["num_workers"] != num_workers:
        log(f"resume: {num_workers} drafter workers now, {state['num_workers']} when the checkpoint was made: "
            f"continuing from batch {cursor} with the same schedule")
    return RunPlan(state["step"], cursor, num_workers, schedule, defining, flags, state["elapsed_s"], state["run_id"])

