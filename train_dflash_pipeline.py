"""Train a DFlash drafter: the frozen target runs in the main thread, drafters train in worker threads.

    command line -> Settings (dflash_train/command_line.py: checked and resolved once, frozen)
      -> data stage (dflash_train/data_stage.py: rows -> documents -> tokenised corpus, cached
         -> fixed-shape packed batches, validation rows, the mask token)
      -> target stage (dflash_train/target_stage.py; main thread, one replica per target device or
         per group of --target-stages devices, only the layers needed)
      -> bounded queue per drafter worker (the target's hidden states already on the worker's device)
      -> drafter workers (here: one thread per drafter device: step, gradient averaging, AdamW);
         several machines under torchrun: one such process each, gradients averaged over all
      -> checkpoints (dflash_train/checkpoints.py: servable drafter + training state) and the run's
         log (train.log, metrics.jsonl, tqdm)

Every batch has the same shape ([rows, max_length], rows = token_budget // max_length) so the
drafter step can be compiled and captured as one CUDA graph (--compile). This file holds the
training itself, top to bottom: the drafter worker, gradient averaging, the learning-rate
schedule, the run's log, held-out measurements, the run the threads share, the main thread's
feed, and Trainer, which runs the stages; main() the command line. docs/architecture.md has the
threads, streams and queues, and why each design choice.
"""

import contextlib
import copy
import gc
import itertools
import json
import math
import os
import queue
import sys
import threading
import time
import traceback
import collections

import torch

import dflash_model as dm
from dflash_train.chat_data import UsageError
from dflash_train.evaluation import accepted_lengths_everywhere, evaluate_drafter_dir, evaluate_models, \
    heldout_prompts, heldout_prompts_file, replayed_over_answers
from dflash_train.flat_adamw import FlatAdamW, GradInto, WeightGradsIntoBuffer, flat_views
from dflash_train.plots import write_plots
from dflash_train.target_model import load_full_target, load_tokenizer
from dflash_train import helpers
from dflash_train.data_stage import prepare_data, validation_row_count
from dflash_train.checkpoints import OutputDirLock, check_init_drafter, checkpoint_steps, claim_output_dir, \
    defining_settings, find_checkpoint, merged_optimizer_state, plan_run, save_checkpoint
from dflash_train.command_line import parse_flags, resolve_settings
from dflash_train.memory_plan import cuda_devices, memory_plan, plan_text
from dflash_train.target_stage import DISTRIBUTION_KEYS, TARGET_INPUTS, TargetReplica, load_target_replicas, \
    warm_up_target
from dflash_train.throughput import StageClock, split_advice
from dflash_train.helpers import budget_error
from dflash_train.helpers import signals_handled
from dflash_train.memory_plan import decoding_bytes, whole_target_parameters
from dflash_train.target_stage import check_against_transformers, tolerance
from dflash_train.checkpoints import final_is_whole, save_final
from dflash_train.memory_plan import plan_verdict
from dflash_train.evaluation import speedup_text

# -----------------------------------------------------------------------------
# Drafter worker: one thread, one device, one replica

# torch.compile (dynamo, inductor, flex_attention's own compile) is not thread-safe, and only
# one CUDA graph capture may be underway in a process: all of it happens under this lock.
COMPILE_LOCK = threading.Lock()
BATCH_KEYS = ("target_hidden", "input_ids", "loss_mask", "doc_ids", "position_ids")


def step_input_keys(settings):
    """The step's inputs in compute_loss's order: the batch's, the anchor noise (drawn by the
    worker), and the target's distribution for a distillation."""
    return BATCH_KEYS + ("anchor_noise",) + (DISTRIBUTION_KEYS if settings.distillation is not None else ())


def compile_every_worker_or_fail():
    """Dynamo keeps one cache per function for the whole process, 8 entries by default, and past
    that runs the function eagerly without a word. Every worker compiles compute_loss for its own
    replica, and the LM-head chunk for its device and shapes (up to 6 entries on one H200), so
    several workers reach 8: allow 64, and make running out an error, never a silent slow worker."""
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, 64)
    cfg.fail_on_recompile_limit_hit = True


def shard_ranges(params, shards):
    """[(first, end)] parameter index ranges of `shards` contiguous shares, as equal in elements
    as whole parameters allow (--shard-optimizer: each worker updates one)."""
    at = [0, *itertools.accumulate(p.numel() for p in params)]
    cuts = [0] + [min(range(1, len(params)), key=lambda i: abs(at[i] - k * at[-1] / shards)) for k in range(1, shards)]
    cuts = [max(c, cuts[k - 1] + 1) if k else c for k, c in enumerate(cuts)]  # each share at least one parameter
    return list(zip(cuts, cuts[1:] + [len(params)]))


class DrafterWorker:
    """Owns a drafter replica, its stream, optimizer and flat gradient buffer. Each step is
    forward+backward -> gradient averaging -> clip + AdamW. With --compile the step is compiled,
    then captured as CUDA graphs (one, or two around the averaging when there are several
    replicas) and each step is: copy the batch into static buffers, replay."""

    def __init__(self, rank, device, drafter, settings, averager, run):
        self.rank, self.device, self.drafter, self.settings, self.averager, self.run = \
            rank, device, drafter, settings, averager, run
        # Rank among all the workers of all the machines: it picks this worker's anchors.
        self.global_rank = averager.cluster.rank * averager.num_workers + rank
        self.input_keys = step_input_keys(settings)
        self.queue = queue.Queue(maxsize=settings.queue_depth)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        params = list(drafter.parameters())
        cuda = device.type == "cuda"
        # One AdamW a device kind: on CUDA one Triton kernel over flat buffers, in the graph
        # (capturable), that keeps the bf16 weights the matmuls read; on the CPU torch's foreach one.
        flat_adamw = cuda
        # All gradients are views of one flat buffer: averaging and clipping are one op each. For
        # FlatAdamW it is bf16, the dtype the matmuls write the weights' gradients in (the norm
        # weights' fp32 ones are rounded to it); torch's AdamW wants its parameters' fp32.
        self.flat_grad = torch.zeros(sum(p.numel() for p in params), device=device,
                                     dtype=torch.bfloat16 if flat_adamw else torch.float32)
        # A tensor learning rate, so a captured optimizer step reads the scheduled value.
        self.lr = torch.tensor(settings.lr, device=device) if cuda else settings.lr
        # --shard-optimizer: this worker's AdamW updates its share of the parameters alone (their
        # moments live here only), then every worker takes each share from its owner (gather)
        self.params = params
        self.offsets = [0, *itertools.accumulate(p.numel() for p in params)]  # each one's place in the flat buffers
        self.shards = shard_ranges(params, averager.num_workers) if settings.shard_optimizer else [(0, len(params))]
        self.share = self.shards[rank] if settings.shard_optimizer else self.shards[0]  # the parameters it updates
        first, end = self.share
        owned, a, b = params[first:end], self.offsets[first], self.offsets[end]
        self.flat_param = None  # with FlatAdamW every weight in flat fp32 and bf16 buffers, the share's updated
        if flat_adamw:
            self.flat_param = torch.cat([p.detach().reshape(-1) for p in params])
            self.weight_bf16 = self.flat_param.to(torch.bfloat16)
            for p, view in zip(params, flat_views(self.flat_param, params)):
                p.data = view
            self.optimizer = FlatAdamW(owned, self.flat_grad[a:b], self.lr, settings.weight_decay,
                                       self.flat_param[a:b], self.weight_bf16[a:b])
        else:
            self.optimizer = torch.optim.AdamW(owned, lr=self.lr, weight_decay=settings.weight_decay, foreach=True)
        copies = flat_views(self.weight_bf16, params) if flat_adamw else [None] * len(params)
        matmul_weights = {f"{m}.weight" for m, mod in drafter.named_modules() if isinstance(mod, torch.nn.Linear)}
        self.grad_into = []  # (name, parameter, its gradient's view, its bf16 copy or None), for compute_loss
        for (name, p), into, bf16 in zip(drafter.named_parameters(), flat_views(self.flat_grad, params), copies):
            if not flat_adamw:  # torch's AdamW reads .grad (FlatAdamW its flat buffer, in another dtype)
                p.grad = into
            self.grad_into.append((name, p, into, bf16 if name in matmul_weights else None))
        if self.stream is not None:  # the buffers above were filled on this thread's stream
            self.stream.wait_stream(torch.cuda.current_stream(device))
        self.generator = torch.Generator(device=device)
        if settings.compile:
            compile_every_worker_or_fail()
        self.loss_fn = self.compute_loss if not settings.compile else torch.compile(
            self.compute_loss, fullgraph=True, dynamic=False,
            options={"post_grad_custom_post_pass": WeightGradsIntoBuffer()})
        self.graphs, self.static, self.static_out = None, None, None
        self.stats, self.losses, self.steps_done = None, [], 0
        self.clock = StageClock()  # busy time of the first steps, for the split advice
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.main, name=f"drafter-{rank}", daemon=True)

    # --- the step ---------------------------------------------------------------------------

    def autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False) if self.device.type == "cuda" \
            else contextlib.nullcontext()

    def compute_loss(self, target_hidden, input_ids, loss_mask, doc_ids, position_ids, anchor_noise,
                     target_top_ids=None, target_top_probs=None):
        """The loss and stats; its backward writes the gradients into the flat buffer (GradInto)."""
        s = self.settings
        params = {name: GradInto.apply(p, into, bf16) for name, p, into, bf16 in self.grad_into}
        kl_weight = s.distillation["kl_weight"] if s.distillation is not None else 0.0
        with self.autocast():
            return torch.func.functional_call(
                self.drafter, params, (target_hidden, input_ids, loss_mask, doc_ids, position_ids, anchor_noise,
                                       target_top_ids, target_top_probs),
                dict(num_anchors=s.num_anchors, gamma=s.loss_decay_gamma, kl_weight=kl_weight,
                     ce_chunk_size=s.ce_chunk_size, attention=s.drafter_attention))

    def accepted_lengths(self, *batch, distribution=None):
        s = self.settings
        # triton, flex: the step's own shape (no new kernels to compile); sdpa (CPU): fewer, larger
        # calls, each a dense mask of up to 4,096 block tokens over the batch's rows
        rows = batch[1].shape[0]
        chunk = s.num_anchors if s.drafter_attention != "sdpa" else max(s.num_anchors, 4096 // (s.block_size * rows))
        with self.autocast():
            return accepted_lengths_everywhere(self.drafter, *batch, chunk, s.ce_chunk_size, s.drafter_attention,
                                               distribution)

    def forward_backward(self, inputs):
        loss, stats = self.loss_fn(*inputs)  # the backward overwrites every gradient: no zeroing
        loss.backward()
        return loss.detach(), stats

    def clip_and_update(self):
        grad_norm = torch.linalg.vector_norm(self.flat_grad, dtype=torch.float32)  # summed in fp32, read once
        clip = torch.clamp(self.settings.grad_clip / (grad_norm + 1e-6), max=1.0)
        if isinstance(self.optimizer, FlatAdamW):  # the kernel scales the gradient as it reads it
            self.optimizer.step(clip)
        else:
            self.flat_grad.mul_(clip)
            self.optimizer.step()
        return grad_norm

    def shard(self, i):
        """The weights of share i (the parameters self.shards[i]): the flat buffers' slices, or
        the parameters themselves."""
        first, end = self.shards[i]
        if self.flat_param is None:
            return [p.detach() for p in self.params[first:end]]
        a, b = self.offsets[first], self.offsets[end]
        return [self.flat_param[a:b], self.weight_bf16[a:b]]

    def optimizer_state(self):
        """This worker's AdamW state, numbered over all the parameters (its share's first index
        added), so the shares' states merge into the state of one unsharded AdamW."""
        state, first = self.optimizer.state_dict(), self.share[0]
        return {"state": {first + k: v for k, v in state["state"].items()},
                "param_groups": [{**g, "params": [first + k for k in g["params"]]} for g in state["param_groups"]]}

    def load_optimizer_state(self, state):
        """Moments and step counts from a checkpoint (an unsharded AdamW's state: with
        --shard-optimizer this worker's share of it). The group settings stay this worker's:
        load_state_dict would replace them with the saved ones, among them a copy of the lr
        tensor, and the captured update would then never see the schedule again."""
        own = {k: v for k, v in self.optimizer.param_groups[0].items() if k != "params"}
        if self.settings.shard_optimizer:
            first, end = self.share
            state = {"state": {k - first: v for k, v in state["state"].items() if first <= k < end},
                     "param_groups": [{**g, "params": list(range(end - first))} for g in state["param_groups"]]}
        self.optimizer.load_state_dict(copy.deepcopy(state))  # a copy: same-device tensors are kept as they are
        self.optimizer.param_groups[0].update(own)

    def anchor_noise(self, step, out):
        # Stateless per (seed, step, rank): a resumed run draws the same anchors.
        self.generator.manual_seed(self.settings.seed * 1_000_003 + step * 131 + self.global_rank)
        return torch.rand(out.shape, generator=self.generator, device=self.device, out=out)

    def set_lr(self, step):
        if isinstance(self.lr, torch.Tensor):
            self.lr.fill_(self.run.lr_for_step(step))
        else:
            self.optimizer.param_groups[0]["lr"] = self.run.lr_for_step(step)

    def train_step(self, step, batch):
        self.set_lr(step)
        if self.graphs is None:
            noise = self.anchor_noise(step, torch.empty(batch["input_ids"].shape, device=self.device))
            loss, stats = self.forward_backward([noise if k == "anchor_noise" else batch[k] for k in self.input_keys])
            self.averager.average(self.rank, self.flat_grad)
            grad_norm = self.clip_and_update()
            self.averager.gather(self.rank, self)
        else:
            for k, buf in zip(self.input_keys, self.static):
                if k == "anchor_noise":
                    self.anchor_noise(step, buf)
                else:
                    buf.copy_(batch[k], non_blocking=True)
            self.graphs[0].replay()
            if len(self.graphs) > 1:
                self.averager.average(self.rank, self.flat_grad)
                self.graphs[1].replay()
                self.averager.gather(self.rank, self)
            loss, stats, grad_norm = self.static_out
        return loss.clone(), torch.cat([stats, grad_norm.detach().float()[None]])

    def warm_up(self):
        """At start-up, one worker at a time (COMPILE_LOCK), before any batch streams: compile
        flex_attention (eager) or compile and capture the whole step (--compile) at the batch
        shape. A token budget that does not fit shows here, with the largest that does."""
        s = self.settings
        t0 = time.perf_counter()
        self.run.log(f"drafter worker {self.rank}: " + ("compiling and capturing the step" if s.compile
                     else "compiling flex_attention") + f" on {self.device}")
        one_row = lambda: self.forward_backward(self.synthetic_inputs(1, self.run.target_hidden_size))
        self.averager.prepare(self.rank, self.flat_grad)
        error = budget_error("drafter step", self.device, s, self.warm_step, one_row, self.drop_capture)
        if error:
            raise RuntimeError(error)
        self.run.log(f"drafter worker {self.rank}: ready in {time.perf_counter() - t0:.0f}s")

    def warm_step(self, rows):
        if self.settings.compile:
            self.capture(rows, self.run.target_hidden_size)
        else:  # flex_attention compiles at this shape; the step's gradient is dropped
            self.forward_backward(self.synthetic_inputs(rows, self.run.target_hidden_size))
            self.flat_grad.zero_()

    # --- compile and capture (at start-up, under COMPILE_LOCK, before the target streams) ------

    def synthetic_inputs(self, rows, target_hidden_size):
        L, dev = self.settings.max_length, self.device
        g = torch.Generator(device=dev).manual_seed(1234 + self.rank)
        vocab = self.drafter.config.vocab_size
        inputs = [torch.randn(rows, L, target_hidden_size, device=dev, dtype=torch.bfloat16, generator=g),
                  torch.randint(0, vocab, (rows, L), device=dev, generator=g),
                  torch.ones(rows, L, device=dev),
                  torch.zeros(rows, L, dtype=torch.long, device=dev),
                  torch.arange(L, device=dev).repeat(rows, 1),
                  torch.rand(rows, L, device=dev, generator=g)]
        if self.settings.distillation is not None:  # k distinct ids, probabilities summing to less than 1
            k = self.settings.distillation["top_k"]
            ids = torch.rand(rows * L, vocab, device=dev, generator=g).topk(k, dim=-1).indices.int()
            inputs += [ids.view(rows, L, k), torch.full((rows, L, k), 0.5 / k, device=dev)]
        return inputs

    def capture(self, rows, target_hidden_size, warmup=3):
        """Compile, warm up, then capture the whole step. The warm-up runs with lr 0 and the
        optimizer state is restored afterwards, so training starts from the state it was given.
        A second call (another averager, say) replaces the first capture, whose memory goes first.
        It runs on the worker's own stream, whichever stream the caller is on."""
        with torch.cuda.stream(self.stream):
            self.drop_capture()
            self.static = self.synthetic_inputs(rows, target_hidden_size)
            state_tensors = lambda: [t for st in self.optimizer.state.values() for t in st.values()
                                     if isinstance(t, torch.Tensor)]
            fresh = all(float(st["step"]) == 0 for st in self.optimizer.state.values())  # no step taken yet
            saved = ([] if fresh else [(t, t.clone()) for t in state_tensors()]) + \
                [(p, p.detach().clone()) for p in self.drafter.parameters()]
            self.lr.fill_(0.0)
            for _ in range(warmup):
                self.forward_backward(self.static)
                self.clip_and_update()
            torch.cuda.current_stream(self.device).synchronize()
            for t, value in saved:
                t.detach().copy_(value)
            # A copy of every parameter and moment (up to 12 GB at 1B parameters): let go before
            # the capture, which empties the allocator's cache for its own pool.
            del saved, value
            if fresh:  # back to zero moments and step 0
                for t in state_tensors():
                    t.zero_()
            if isinstance(self.optimizer, FlatAdamW):
                self.weight_bf16.copy_(self.flat_param)
            several = self.averager.active  # the averaging sits between two graphs
            g1 = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g1, stream=self.stream, capture_error_mode="thread_local"):
                loss, stats = self.forward_backward(self.static)
                grad_norm = None if several else self.clip_and_update()
            self.graphs = [g1]
            if several:
                g2 = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g2, pool=g1.pool(), stream=self.stream, capture_error_mode="thread_local"):
                    grad_norm = self.clip_and_update()
                self.graphs.append(g2)
            self.static_out = (loss, stats, grad_norm)
            torch.cuda.current_stream(self.device).synchronize()

    def drop_capture(self):
        """Back to the uncaptured step; the graphs' pool and static buffers are let go."""
        self.graphs = self.static = self.static_out = None

    def get_batch(self):
        """The next batch, or None at the end of the run (sentinel) or when the run stops."""
        while not self.run.stop.is_set():
            try:
                return self.queue.get(timeout=0.2)
            except queue.Empty:
                pass
        return None

    def main(self):
        try:
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                if self.device.type == "cuda":
                    with COMPILE_LOCK:  # never held across the gradient averaging: that would deadlock
                        self.warm_up()
                self.ready.set()
                self.loop()
        except threading.BrokenBarrierError:
            pass  # another worker failed; its error is the one reported
        except BaseException:
            self.run.fail(f"drafter worker {self.rank} on {self.device}", traceback.format_exc())

    def loop(self):
        step = self.steps_done = self.run.start_step
        while (batch := self.get_batch()) is not None:
            if self.stream is not None:  # the batch was copied on another stream
                self.stream.wait_event(batch.pop("ready"))
                for v in batch.values():
                    v.record_stream(self.stream)
            step += 1
            clock = self.clock  # timed until the split advice is given
            if clock is not None:
                clock.start(self.device)
            loss, stats = self.train_step(step, batch)
            if clock is not None:
                clock.stop(self.device)
            self.stats = stats if self.stats is None else self.stats + stats
            self.losses.append(loss)
            self.steps_done = step
            self.run.step_done(self, step)
            if self.averager.stop_agreed:  # another machine was signalled: every machine ends after this step
                self.run.interrupted = True
                return


# -----------------------------------------------------------------------------
# Gradient averaging across drafter replicas: the threads of this process, and the machines

class Cluster:
    """This process's place among the machines of a run: one process per machine (launched by
    torchrun, which sets WORLD_SIZE and RANK), each running this whole pipeline on its own GPUs.
    Alone (no torchrun): rank 0 of 1, and every method below is a no-op."""

    def __init__(self, rank=0, world_size=1, device=None):
        self.rank, self.world_size = rank, world_size
        self.device = device  # where collectives run: the first drafter device (NCCL) or the CPU (gloo)

    @classmethod
    def from_env(cls, drafter_devices, timeout_s):
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls()
        cuda = drafter_devices[0].type == "cuda"
        if cuda and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
            raise UsageError("one process per machine: launch with torchrun --nproc-per-node 1 (each process "
                             "drives all of its machine's GPUs through --target-gpus/--drafter-gpus)")
        import datetime
        import torch.distributed as dist
        if cuda:
            torch.cuda.set_device(drafter_devices[0])
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
        return cls(dist.get_rank(), world, drafter_devices[0] if cuda else torch.device("cpu"))

    @property
    def is_main(self):
        return self.rank == 0

    def all_reduce_(self, t, op="sum"):
        """In place across the processes (t on any device; moved to self.device and back)."""
        if self.world_size == 1:
            return t
        import torch.distributed as dist
        x = t.to(self.device)
        dist.all_reduce(x, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
        if x is not t:
            t.copy_(x)
        return t

    def check_same(self, what, values):
        """Stop unless every process has the same values (e.g. the step to resume from)."""
        if self.world_size == 1:
            return
        lo = self.all_reduce_(torch.tensor(values, dtype=torch.long), "min")
        hi = self.all_reduce_(torch.tensor(values, dtype=torch.long), "max")
        if not torch.equal(lo, hi):
            raise UsageError(f"the machines disagree on {what}: {lo.tolist()} on one, {hi.tolist()} on another "
                             "(same --data, flags and a checkpoint directory every machine can read are needed)")

    def close(self):
        if self.world_size > 1:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()


class GradAverager:
    """Every worker hands in its flat gradient buffer; the last to arrive averages them all into
    every buffer, across the machines too. An aborted barrier (a failed worker) raises in all the
    others. Over several machines the same reduction also agrees on stopping: a stop asked for on
    any machine (a signal) ends every machine's run after the same step. The buffers' dtype is
    the workers' (bf16 with FlatAdamW), so is the sum's."""

    def __init__(self, num_workers, cluster=None, stop_requested=lambda: False):
        self.num_workers, self.cluster = num_workers, cluster or Cluster()
        self.active = num_workers > 1 or self.cluster.world_size > 1  # is there anything to average
        self.stop_requested, self.stop_agreed = stop_requested, False
        self.buffers, self.streams = [None] * num_workers, [None] * num_workers
        self.barrier = threading.Barrier(num_workers, action=self._average) if num_workers > 1 else None
        self.workers = [None] * num_workers  # with --shard-optimizer, for the gather
        self.shard_barrier = threading.Barrier(num_workers, action=self._gather) if num_workers > 1 else None
        self.across = None  # over several machines: this machine's sum and the stop vote, reduced together

    def prepare(self, rank, flat_grad):
        """At warm-up, before the token budget is tried: the buffer the cross-machine reduction
        needs (gradients + 1), so a budget that fits does not run out of memory at step 1."""
        if rank == 0 and self.cluster.world_size > 1 and self.across is None:
            self.across = flat_grad.new_empty(flat_grad.numel() + 1)

    def _average(self):
        buffers = self.buffers
        # One GPU per worker: one NCCL all-reduce, every GPU's links busy at once (2 x 4.2 GB:
        # 14 ms against 30 ms through the first GPU, on two H200s).
        if len(buffers) > 1 and all(b.is_cuda for b in buffers) and torch.cuda.nccl.is_available(buffers):
            self._average_nccl(buffers)
            return
        for stream in self.streams:
            if stream is not None:  # the gradients are read from this thread
                stream.synchronize()
        first = buffers[0]
        for b in buffers[1:]:
            first += b.to(first.device)
        if self.cluster.world_size > 1:
            self._across_machines(first)
        first /= self.num_workers * self.cluster.world_size
        for b in buffers[1:]:
            b.copy_(first)
        for b in buffers:
            if b.is_cuda:
                torch.cuda.synchronize(b.device)

    def _average_nccl(self, buffers):
        """On each worker's own stream, after its backward and before its update there, so the
        host waits for nothing and no other work on those GPUs (a target forward, the next
        batch's copy) holds the averaging up."""
        streams = self.streams
        torch.cuda.nccl.all_reduce(buffers, streams=streams)  # in place: every buffer holds this machine's sum
        if self.cluster.world_size > 1:
            with torch.cuda.stream(streams[0]):
                self._across_machines(buffers[0])
            torch.cuda.nccl.broadcast(buffers, root=0, streams=streams)
        for b, stream in zip(buffers, streams):
            with torch.cuda.stream(stream):
                b /= self.num_workers * self.cluster.world_size

    def _across_machines(self, local_sum):
        """local_sum <- the sum over every machine; the stop vote rides in the same reduction (one
        slot more than the gradients)."""
        self.prepare(0, local_sum)
        total = self.across
        total[:-1].copy_(local_sum)
        total[-1] = float(self.stop_requested())
        self.cluster.all_reduce_(total)
        local_sum.copy_(total[:-1])
        self.stop_agreed = bool(total[-1] > 0)

    def average(self, rank, flat_grad):
        """Called by every worker on its own stream with its gradients queued there; returns with
        the average queued on that stream (or done, off the NCCL path)."""
        if not self.active:
            return
        if flat_grad.device.type == "cuda":
            self.streams[rank] = torch.cuda.current_stream(flat_grad.device)
        self.buffers[rank] = flat_grad
        if self.barrier is None:
            self._average()
        else:
            self.barrier.wait()

    def gather(self, rank, worker):
        """With --shard-optimizer, after every worker's update of its share: each share's
        weights copied from its owner to every other worker (on the host's order: the workers'
        streams are waited for first). A no-op otherwise."""
        if not worker.settings.shard_optimizer or self.num_workers == 1:
            return
        self.workers[rank] = worker
        self.shard_barrier.wait()

    def _gather(self):
        for w in self.workers:
            if w.stream is not None:
                w.stream.synchronize()
        for i, owner in enumerate(self.workers):
            for w in self.workers:
                if w is not owner:
                    for dst, src in zip(w.shard(i), owner.shard(i)):
                        dst.copy_(src)
        for w in self.workers:
            if w.device.type == "cuda":
                torch.cuda.synchronize(w.device)

    def abort(self):
        if self.barrier is not None:
            self.barrier.abort()
            self.shard_barrier.abort()


# -----------------------------------------------------------------------------
# Learning-rate schedule

def scheduled_lr(batches_done, schedule, peak):
    """Linear warm-up, the peak held, then cosine to zero over the run's last decay_batches, all
    counted in batches (not steps: a run resumed with another worker count keeps its schedule).
    batches_done counts the step's own."""
    total, warmup, decay = schedule["total_batches"], schedule["warmup_batches"], schedule["decay_batches"]
    if batches_done <= warmup:
        return peak * batches_done / max(1, warmup)
    progress = (batches_done - (total - decay)) / max(1, decay)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, progress))))


# -----------------------------------------------------------------------------
# The run's log: train.log lines, metrics.jsonl records, the step bar, the training clock

class RunLog:
    """Timestamped lines to the terminal and to train.log (one file per machine), and records to
    metrics.jsonl (the first machine's only), each whole line flushed as it is written. While the
    step bar shows, lines go above it. Callable: log("message")."""

    def __init__(self, output_dir, cluster):
        os.makedirs(output_dir, exist_ok=True)
        name = "train.log" if cluster.is_main else f"train.rank{cluster.rank}.log"
        self.file = open(os.path.join(output_dir, name), "a")
        self.metrics_path = os.path.join(output_dir, "metrics.jsonl")
        self.metrics = open(self.metrics_path, "a") if cluster.is_main else None
        self.bar = None  # the step bar while batches stream (start_steps .. end_steps)
        self.before_s, self.t_start = 0.0, None  # training seconds of earlier processes; this one's start

    def __call__(self, msg):
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()

    def start_steps(self, total, initial, before_s, show):
        """The clock starts (before_s: seconds a resumed run trained before) and the step bar shows."""
        from tqdm import tqdm
        self.before_s, self.t_start = before_s, time.perf_counter()
        self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, disable=None if show else True)

    def end_steps(self):
        if self.bar is not None:
            self.bar.close()
        self.bar = None

    def elapsed_s(self):
        """Seconds of training so far, resumed runs' earlier processes included (validations and
        evaluations count: they are part of what a run costs)."""
        return self.before_s + (time.perf_counter() - self.t_start if self.t_start is not None else 0.0)

    def drop_records_after(self, step):
        """metrics.jsonl without the records of steps after `step` (a resumed run redoes them) and
        without a torn last line (a kill or a full disk mid-write); rewritten whole, then reopened."""
        if self.metrics is None:
            return
        self.metrics.close()
        with open(self.metrics_path) as f:
            lines = f.readlines()
        def before(line):
            try:
                return line.endswith("\n") and json.loads(line).get("step", 0) <= step
            except ValueError:
                return False
        kept = [line for line in lines if before(line)]
        if len(kept) != len(lines):
            self(f"metrics.jsonl: {len(lines) - len(kept)} records after step {step} (or torn) dropped")
            tmp = self.metrics_path + ".tmp"
            with open(tmp, "w") as f:
                f.writelines(kept)
            os.replace(tmp, self.metrics_path)
        self.metrics = open(self.metrics_path, "a")

    def record(self, rec):
        """One line of metrics.jsonl (first machine only), stamped with the training time so far.
        A metrics.jsonl deleted during the run is recreated and said, never written to unseen."""
        if self.metrics is not None:
            if not os.path.exists(self.metrics_path):
                self.metrics.close()
                self.metrics = open(self.metrics_path, "a")
                self(f"metrics.jsonl was deleted during the run: recreated at step {rec['step']}, the records "
                     "before it are gone")
            self.metrics.write(json.dumps({"step": rec["step"], "elapsed_s": round(self.elapsed_s(), 1), **rec}) + "\n")
            self.metrics.flush()


# -----------------------------------------------------------------------------
# Held-out measurements during a run: validation rows and evaluation prompts

class HeldOut:
    """The figures a run logs on documents and prompts it never trains on: the validation rows'
    loss, accuracy, tau_hat and decoding replayed over their answers (--val-interval), and the
    real acceptance length on held-out prompts (--eval-interval). `validation`: the rows
    (validation_batches), their target hidden states added once the target stage is up."""

    # The validation rows' target distribution at --eval-temperature travels as its top k: a
    # proposal outside them counts as rejected (a lower bound, by at most the rest of the mass).
    SAMPLED_TOP_K = 64

    def __init__(self, settings, validation, tokenizer, prompts, cuda_devices, log):
        self.settings, self.validation, self.tokenizer, self.prompts = settings, validation, tokenizer, prompts
        self.cuda_devices, self.log = cuda_devices, log
        self.target = None  # the whole target, loaded on first use (full_target)
        self.sampled = None  # per validation batch, the target's top-k at --eval-temperature (sampled_distributions)

    def add_target_outputs(self, replica):
        """Each validation batch's target outputs (hidden states; the distribution for a
        distillation), once (eager: a captured forward has the training batch's shape)."""
        with torch.no_grad():
            self.validation = [dict(batch, **{k: v.cpu() for k, v in replica.forward(
                **{k: batch[k] for k in TARGET_INPUTS}).items()}) for batch in self.validation]

    @torch.no_grad()
    def validate(self, worker, step, tau_hat):
        """Loss, accuracy per slot and tau_hat of the held-out rows (the same anchors every time),
        beside the training figures: a gap that grows is memorisation. And greedy decoding
        replayed over their answers: tau_hat averages every position alike, while decoding
        starts each block where the last one failed, so it lands on the hard positions more often,
        and reads as the measured acceptance length does (docs/recipe.md compares the three)."""
        w, stats, answers, sampled = worker, 0, [], []
        distributions = self.sampled_distributions() if self.settings.eval_temperature > 0 else None
        for i, batch in enumerate(self.validation):
            on_device = {key: batch[key].to(w.device) for key in w.input_keys}
            inputs = [on_device[key] for key in BATCH_KEYS]
            _, st = w.compute_loss(*on_device.values())
            stats = stats + st.float().cpu()
            taus_of_rows = w.accepted_lengths(*inputs).tolist()
            if distributions is not None:
                expected = w.accepted_lengths(*inputs, distribution=[t.to(w.device) for t in distributions[i]]).cpu()
                sampled.append(expected[dm.DFlashDraftModel.anchor_can_draft(batch["loss_mask"], batch["doc_ids"])])
            for taus, loss_mask, doc_ids in zip(taus_of_rows, batch["loss_mask"], batch["doc_ids"]):
                answers += replayed_over_answers(lambda p, end, taus=taus: taus[p], loss_mask, doc_ids)
        m = dm.stats_to_metrics(stats, len(self.validation))
        mean = lambda lists: sum(map(sum, lists)) / max(sum(map(len, lists)), 1)  # noqa: E731  (tokens per block)
        replayed, first = mean([g for g, _ in answers]), mean([g for g, is_first in answers if is_first])
        # first answers are what a one-turn benchmark asks; later ones see their own history
        self.log(f"val step {step}: loss {m['loss']:.4f} acc {m['acc_mean']:.3f} tau_hat {m['tau_hat']:.3f}, "
                 f"decoding replayed {replayed:.3f} (first answers {first:.3f}) on "
                 f"{validation_row_count(self.validation)} held-out rows (training tau_hat {tau_hat:.3f})")
        rec = {"step": step, "val_loss": m["loss"], "val_acc": m["acc_mean"], "val_acc_per_slot": m["acc"],
               "val_tau_hat": m["tau_hat"], "val_acceptance_length": replayed,
               "val_acceptance_length_first_answers": first}
        if sampled:
            rec["val_sampled_tau_hat"] = torch.cat(sampled).float().mean().item()
            self.log(f"val step {step} at temperature {self.settings.eval_temperature:g}: expected acceptance "
                     f"(sampled tau_hat) {rec['val_sampled_tau_hat']:.3f}")
        self.log.record(rec)
        return replayed, first

    def sampled_distributions(self):
        """Per validation batch, the whole target's next-token distribution at --eval-temperature
        as its top SAMPLED_TOP_K (ids, probabilities), for the sampled tau_hat; computed once, by
        the target that evaluates (full_target: the stage's replicas stop at the deepest layer the
        drafter reads)."""
        if self.sampled is None:
            target = self.full_target()
            at_eval_temperature = dict(top_k=self.SAMPLED_TOP_K, temperature=self.settings.eval_temperature)
            stage = TargetReplica(target, (), next(target.parameters()).device, stack_mlps=False,
                                  distillation=at_eval_temperature)  # no features: the distribution alone
            self.sampled = [[stage.outputs(batch)[k].cpu() for k in DISTRIBUTION_KEYS] for batch in self.validation]
        return self.sampled

    def full_target(self):
        """The whole target for evaluations, loaded once, on the device with the most free memory
        if it fits there with room to spare (the token budget may have filled the drafter GPUs),
        else on the CPU."""
        if self.target is None:
            params = whole_target_parameters(self.settings.target_config) or 0
            free = {d: torch.cuda.mem_get_info(d)[0] for d in self.cuda_devices}
            dev = max(free, key=free.get) if free else torch.device("cpu")
            if free and free[dev] < decoding_bytes(params):
                self.log(f"eval: the target ({2 * params / 2**30:.1f} GB in bf16) does not fit beside the run on any "
                         f"GPU (most free: {free[dev] / 2**30:.1f} GB on {dev}); evaluating on the CPU")
                dev = torch.device("cpu")
            self.target = load_full_target(self.settings.target_model, dev)
        return self.target

    def evaluate(self, drafter, step, tau_hat, val_replayed=None):
        """The real acceptance length of the current drafter (lossless speculative decoding on
        held-out prompts) next to the training estimate tau_hat of the last log interval, the
        teacher-forced figures on the target's own answers to those prompts, and the validation's
        replay (all answers, first answers) just before."""
        target = self.full_target()
        dev = next(target.parameters()).device
        drafter = copy.deepcopy(drafter).to(dev).eval().attach_target(target)
        s = self.settings
        measure = lambda temperature: evaluate_models(  # noqa: E731
            target, self.tokenizer, drafter, self.prompts, dev, s.eval_max_new_tokens, lambda m: None,
            s.chat_template_kwargs, show_progress=False, temperature=temperature, seed=s.seed)
        report = measure(0.0)
        measured = report["acceptance_length"]
        tf = report["teacher_forced_tau_hat"]
        rel = lambda x: f"{(x - measured) / measured:+.1%}"
        self.log(f"eval step {step}: acceptance length {measured:.3f} measured on {len(self.prompts)} held-out "
                 f"prompts vs tau_hat {tau_hat:.3f} estimated in training ({rel(tau_hat)}); on the target's own "
                 f"answers to those prompts tau_hat {tf:.3f} ({rel(tf)}), "
                 f"decoding replayed {report['teacher_forced_acceptance_length']:.3f}; lossless {report['lossless']}"
                 + ("" if val_replayed is None else "; replayed on held-out training documents {:.3f} (first "
                    "answers {:.3f})".format(*val_replayed)))
        rec = {"step": step, "eval_acceptance_length": measured, "tau_hat": tau_hat, "teacher_forced_tau_hat": tf,
               "eval_lossless": report["lossless"], "eval_acceptance_per_slot": report["acceptance_per_slot"]}
        t = s.eval_temperature
        if t > 0:
            sampled = measure(t)
            self.log(f"eval step {step} at temperature {t:g}: acceptance length {sampled['acceptance_length']:.3f} "
                     f"(prompt lookup {sampled['prompt_lookup_acceptance_length']:.3f}); per slot "
                     f"{sampled['acceptance_per_slot']}")
            rec.update(eval_sampled_acceptance_length=sampled["acceptance_length"], eval_temperature=t)
        self.log.record(rec)


# -----------------------------------------------------------------------------
# The run: what the main thread and the drafter workers share while batches stream

HEALTH_WINDOW = 3  # metrics lines the health check looks back over


class Run:
    """The stop flag and errors, the step bookkeeping (each worker reports each step; the last
    one in logs, validates, evaluates and saves), the metrics, and the checkpoint duty. One
    DrafterWorker per drafter device (settings.drafter_devices), all averaging their gradients
    through one GradAverager."""

    def __init__(self, settings, plan, batches, drafters, log, held_out, cluster=None):
        self.settings, self.plan, self.batches, self.log, self.held_out = settings, plan, batches, log, held_out
        self.cluster = cluster or Cluster()
        self.start_step, self.total_steps = plan.start_step, plan.total_steps
        self.cuda_devices = cuda_devices(settings)
        self.stop = threading.Event()
        self.stop_asked = False  # a signal arrived here; over several machines the workers agree on when
        self.interrupted = False  # feeding stops at a step boundary and the run ends with a save
        self.errors, self.lock, self.reported = [], threading.Lock(), {}
        self.target_hidden_size = len(settings.target_layer_ids) * drafters[0].config.hidden_size
        self.averager = GradAverager(len(drafters), self.cluster, stop_requested=lambda: self.stop_asked)
        self.workers = [DrafterWorker(i, dev, d, settings, self.averager, self)
                        for i, (dev, d) in enumerate(zip(settings.drafter_devices, drafters))]
        if settings.shard_optimizer and len(self.workers) > 1:
            params = self.workers[0].params
            shares = [sum(p.numel() for p in params[a:b]) / 1e6 for a, b in self.workers[0].shards]
            log(f"drafter: AdamW state sharded over {len(self.workers)} workers (shares of "
                f"{', '.join(f'{m:.1f}M' for m in shares)} parameters)")
        self.last_log = (time.perf_counter(), plan.start_step)  # (when, step) of the last metrics line
        self.recent = collections.deque(maxlen=HEALTH_WINDOW)  # (loss, grad norm) of the last metrics lines
        self.first_weight_norm, self.health_said = None, set()
        # the target stage's busy time, a clock per replica stage (the slowest bounds a replica)
        self.target_clocks = [StageClock() for _ in range(settings.target_stages)]
        self.target_batches_fed, self.target_logged = 0, (0.0, 0)

    def lr_for_step(self, step):
        return scheduled_lr(self.plan.cursor_after(step), self.plan.schedule, self.settings.lr)

    def fail(self, where, tb):
        with self.lock:
            self.errors.append((where, tb))
        self.stop.set()
        self.averager.abort()

    def step_done(self, worker, step):
        """Each worker calls this after each step. The last worker to finish a logged or saved step
        writes the log line or the checkpoint; no worker can finish step+1 meanwhile (gradient
        averaging waits for all), so the replicas' state is consistent."""
        if worker.rank == 0 and self.log.bar is not None:
            self.log.bar.update(1)
        s = self.settings
        first_machine, last = self.cluster.is_main, step == self.total_steps
        # the last step's acceptance is the final evaluation's (not measured twice)
        eval_step = bool(s.eval_interval) and step % s.eval_interval == 0 and not (last and s.eval_prompts > 0)
        val_step = eval_step or last or (bool(s.val_interval) and step % s.val_interval == 0)
        # Every machine logs on the same steps (the figures are summed across machines); only the
        # first evaluates and saves.
        due_log = step % s.log_interval == 0 or last or eval_step or val_step
        due_eval = eval_step and bool(self.held_out.prompts) and first_machine
        due_val = val_step and bool(self.held_out.validation) and first_machine
        due_save = (step % s.save_interval == 0 or last) and first_machine
        if not (due_log or due_save):
            return
        if worker.stream is not None:
            worker.stream.synchronize()  # its results are read from another thread below
        with self.lock:
            done = self.reported.setdefault(step, set())
            done.add(worker.rank)
            if len(done) < len(self.workers):
                return
            del self.reported[step]
        self.check_finite(step)
        if first_machine and not os.path.isdir(s.output_dir):
            os.makedirs(s.output_dir, exist_ok=True)
            self.save(step)
            raise RuntimeError(f"--output-dir {s.output_dir} vanished during the run; step {step} was saved to a "
                               "recreated one, and the run stops (its logs and metrics were lost with the directory)")
        if due_log:
            rec = self.write_metrics(step)
        val_replayed = self.held_out.validate(self.workers[0], step, rec["tau_hat"]) if due_val else None
        if due_eval:
            self.held_out.evaluate(self.workers[0].drafter, step, rec["tau_hat"], val_replayed)
        if due_save:
            self.save(step)

    def save(self, step):
        s = self.settings
        path = save_checkpoint(s.output_dir, step, self.workers[0], self.plan, s.keep_checkpoints,
                               merged_optimizer_state(self.workers), self.log.elapsed_s())
        self.log(f"checkpoint: {path}")

    @property
    def num_workers(self):
        """Drafter workers on all the machines: each step consumes this many batches."""
        return len(self.workers) * self.cluster.world_size

    def check_finite(self, step):
        for w in self.workers:
            if not w.losses:
                continue
            losses = torch.stack(w.losses).float().cpu()
            bad = (~torch.isfinite(losses)).nonzero()
            if len(bad):
                first = step - len(losses) + 1 + int(bad[0])
                raise FloatingPointError(f"non-finite loss at step {first} (drafter worker {w.rank}); stopped "
                                         "without saving, the last good checkpoint is kept")
            w.losses = []

    def write_metrics(self, step):
        now = time.perf_counter()
        t_prev, s_prev = self.last_log
        dt, steps, W = max(now - t_prev, 1e-9), step - s_prev, self.num_workers
        stats = self.cluster.all_reduce_(sum(w.stats.cpu() for w in self.workers))
        m = dm.stats_to_metrics(stats[:-1], steps * W)
        target_s, target_n = max(c.total() for c in self.target_clocks)  # the slowest stage's
        target_dt, target_batches = target_s - self.target_logged[0], target_n - self.target_logged[1]
        self.target_logged = (target_s, target_n)
        budget = self.settings.token_budget
        rec = {
            "step": step, "epoch": round(self.plan.cursor_after(step) / self.batches.batches_per_epoch, 3),
            "tokens_per_s": steps * W * budget / dt,
            "real_tokens_per_s": steps * W * budget * self.batches.packing_efficiency / dt,
            "target_tokens_per_s": target_batches * budget / target_dt if target_dt > 0 else None,
            "drafter_steps_per_s": steps / dt,
            "queue_depths": [w.queue.qsize() for w in self.workers],
            "loss": m["loss"], "acc": m["acc_mean"], "acc_per_slot": m["acc"], "tau_hat": m["tau_hat"],
            "lr": self.lr_for_step(step), "grad_norm": float(stats[-1]) / max(steps * W, 1),
            "peak_mem_gb": {str(d): round(torch.cuda.max_memory_allocated(d) / 2**30, 2) for d in self.cuda_devices},
        }
        for w in self.workers:
            w.stats = None
        self.last_log = (now, step)
        self.advise_split(target_s, target_n)
        rec["weight_norm"] = float(torch.linalg.vector_norm(torch.stack(
            [p.detach().float().norm() for p in self.workers[0].drafter.parameters()])))
        self.log.record(rec)
        self.check_health(step, rec)
        tt = f"{rec['target_tokens_per_s']:,.0f}" if rec["target_tokens_per_s"] else "-"
        self.log(f"step {step}/{self.total_steps} ep {rec['epoch']:.2f} | tok/s {rec['tokens_per_s']:,.0f} "
                 f"(real {rec['real_tokens_per_s']:,.0f}, target stage {tt}) | drafter "
                 f"{rec['drafter_steps_per_s']:.2f} step/s | queues {rec['queue_depths']} | loss {m['loss']:.4f} "
                 f"acc {m['acc_mean']:.3f} tau {m['tau_hat']:.2f} | lr {rec['lr']:.2e} gnorm {rec['grad_norm']:.3f}"
                 + (f" | peak GB {rec['peak_mem_gb']}" if rec["peak_mem_gb"] else ""))
        return rec

    def check_health(self, step, rec):
        """A run that trains nothing is said in the log (and in metrics.jsonl as `health`), once:
        gradients about zero with the loss flat over the last HEALTH_WINDOW metrics lines (a dead
        drafter: a learning rate far too high saturates it), or weights grown a hundredfold."""
        self.recent.append((rec["loss"], rec["grad_norm"]))
        self.first_weight_norm = self.first_weight_norm or rec["weight_norm"]
        losses = [loss for loss, _ in self.recent]
        problems = {}
        if len(self.recent) == HEALTH_WINDOW and max(g for _, g in self.recent) < 1e-4 and \
                max(losses) - min(losses) <= 1e-3 * abs(losses[-1]):
            problems["dead"] = (f"the gradient norm is about 0 and the loss flat at {losses[-1]:.4f} over the last "
                                f"{HEALTH_WINDOW} log lines: the drafter trains nothing (is --lr far too high?)")
        if rec["weight_norm"] > 100 * self.first_weight_norm:
            problems["exploding"] = (f"the weights' norm grew from {self.first_weight_norm:.3g} to "
                                     f"{rec['weight_norm']:.3g} (is --lr far too high?)")
        for kind, text in problems.items():
            if kind not in self.health_said:
                self.health_said.add(kind)
                self.log(f"health: step {step}: {text}")
                self.log.record({"step": step, "health": kind})

    def advise_split(self, target_s, target_n):
        """Logs split_advice once both stages have timed two batches; then the workers stop timing."""
        if self.workers[0].clock is None or target_n < 2:  # given already, or too early
            return
        drafter = [w.clock.total() for w in self.workers]
        if min(n for _, n in drafter) < 2:
            return
        for w in self.workers:
            w.clock = None
        advice = split_advice(target_s / target_n, max(s / n for s, n in drafter), self.settings.target_devices,
                              [w.device for w in self.workers], self.settings.token_budget)
        self.log(advice["line"])


# -----------------------------------------------------------------------------
# The main thread: target forward per batch, target hidden states to a worker's device, into its queue

def put(run, worker, item):
    while not run.stop.is_set() and worker.thread.is_alive():
        try:
            worker.queue.put(item, timeout=0.2)
            return
        except queue.Full:
            pass


def feed(run, replicas):
    """Batches go round-robin over target replicas and workers, a whole round (one batch per
    worker) per step, so every worker runs the same number of steps. Over several machines a
    step's round spans the workers of all of them, and this machine feeds its own slice of it.
    Ends with a sentinel."""
    first = run.cluster.rank * len(run.workers)
    batches = run.batches.iterate(run.plan.start_cursor, run.num_workers, range(first, first + len(run.workers)))
    step = run.start_step
    while step < run.total_steps and not run.stop.is_set() and not run.interrupted:
        for w in run.workers:
            _, batch = next(batches)
            replica = replicas[run.target_batches_fed % len(replicas)]
            if "cuda" in (replica.device.type, w.device.type):
                # a copy from pageable memory blocks this thread until the stream's queued work is
                # done (a target forward, say); from pinned memory it is queued like the rest
                batch = {k: v.pin_memory() for k, v in batch.items()}
            outputs = replica.outputs(batch, run.target_clocks)
            item = {k: v.to(w.device, non_blocking=True) for k, v in batch.items()}
            # A graphed replica returns its static outputs, overwritten by the next replay: copy them.
            item.update({k: v.to(w.device, non_blocking=True, copy=replica.graphs is not None)
                         for k, v in outputs.items()})
            if w.device.type == "cuda":
                item["ready"] = torch.cuda.Event()
                item["ready"].record(torch.cuda.current_stream(w.device))
            run.target_batches_fed += 1
            put(run, w, item)
        step += 1
    for w in run.workers:
        put(run, w, None)
    return step


def join_workers(run, timeout_after_error=30.0):
    """Wait for the workers; once any thread has failed, give the others a bounded time."""
    failed_at = None
    while any(w.thread.is_alive() for w in run.workers):
        for w in run.workers:
            w.thread.join(timeout=0.2)
        if run.errors and failed_at is None:
            failed_at = time.time()
        if failed_at is not None and time.time() - failed_at > timeout_after_error:
            break


def run_pipeline(run, replicas, optimizer_state=None, show_progress=True):
    """Warm up (and with --compile capture) every stage, then stream batches until the run ends,
    the run is interrupted, or any thread fails. Errors are left in run.errors."""
    settings = run.settings
    if any(d.type == "cuda" for d in settings.drafter_devices + [r.device for r in replicas]):
        # Workers need the interpreter between the main thread's Python ops (docs/architecture.md).
        sys.setswitchinterval(settings.switch_interval)
    if optimizer_state is not None:
        for w in run.workers:
            w.load_optimizer_state(optimizer_state)
    warm_up_target(replicas, settings, run.log)
    run.held_out.add_target_outputs(replicas[0])

    # SIGINT/SIGTERM stop feeding at a step boundary; the end of the run saves.
    def on_signal(signum):
        run.stop_asked = True
        if run.cluster.world_size == 1:
            run.log(f"signal {signum}: finishing the queued steps, saving a checkpoint, exiting")
            run.interrupted = True
        else:
            run.log(f"signal {signum}: every machine stops after the next step, then a checkpoint is saved")
    for w in run.workers:
        w.thread.start()
    with signals_handled(on_signal):
        try:
            # Captures happen one worker at a time, before any batch streams (docs/architecture.md).
            while not all(w.ready.is_set() for w in run.workers) and not run.stop.is_set():
                time.sleep(0.05)
            run.log.start_steps(run.total_steps, run.start_step, run.plan.start_elapsed_s,
                                show_progress and run.cluster.is_main)
            run.last_log = (time.perf_counter(), run.start_step)
            feed(run, replicas)
        except BaseException:
            run.fail("target stage (main thread)", traceback.format_exc())
        join_workers(run)
    run.log.end_steps()
    return run


def build_drafters(settings, mask_token_id, embed, head, log):
    """One drafter replica per drafter device, identical at the start, each with the target's
    frozen embedding and LM head on its device."""
    cfg = dm.make_drafter_config(settings.target_config, mask_token_id=mask_token_id,
                                 num_draft_layers=settings.num_draft_layers, block_size=settings.block_size,
                                 target_layer_ids=settings.target_layer_ids)
    torch.manual_seed(settings.seed)
    master = dm.DFlashDraftModel(cfg)
    drafters = []
    for dev in settings.drafter_devices:
        d = dm.DFlashDraftModel(cfg)
        d.load_state_dict(master.state_dict())  # replicas start identical
        d.to(dev).train()
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        d.set_target_parts(dm.embedding_on(embed, dev, dtype), head.to(dev, dtype))
        drafters.append(d)
    log(f"drafter: {master.num_parameters() / 1e6:.1f}M parameters, {cfg.num_hidden_layers} layers, block "
        f"{cfg.block_size}, target layers {master.target_layer_ids}, mask token {mask_token_id}; "
        f"{settings.drafter_attention} attention")
    return drafters


# -----------------------------------------------------------------------------
# One run, stage by stage: the command line and the smoke test call the same stages

def packed_batch(batches, cursor, look=64):
    """The first batch from the cursor on with a row of several documents (within `look`
    batches; else the first), for the target check: a document boundary is where a stage that
    carries state across documents shows."""
    first = None
    for _, (_, batch) in zip(range(look), batches.iterate(cursor)):
        first = first or batch
        if max(len(set(row.tolist()) - {-1}) for row in batch["doc_ids"]) > 1:
            return batch
    return first


def fmt_errors(errors):
    return ", ".join(f"{layer}: {e:.1e}" for layer, e in errors.items())


class Trainer:
    """A run in five stages: load_data (the corpus, batches, validation rows, the mask token,
    and where a resumed run starts), load_models (the target stage and the drafter replicas),
    check_target (the stage against the model's own forward), train (warm-up, capture, the
    steps), finish (the final drafter, its evaluation, the plots)."""

    def __init__(self, settings, cluster=None):
        self.settings, self.cluster = settings, cluster or Cluster()
        if settings.shard_optimizer and self.cluster.world_size > 1:
            raise UsageError("--shard-optimizer splits the optimizer over the drafter workers of one machine; over "
                             "several machines (torchrun) it is not built: drop it, or train on one machine")
        # The first machine owns the output directory: one run at a time, and not another run's files
        self.lock = OutputDirLock(settings.output_dir) if self.cluster.is_main else None
        cleared = claim_output_dir(settings) if self.cluster.is_main else []
        self.log = RunLog(settings.output_dir, self.cluster)
        if cleared:
            self.log(f"--overwrite: the earlier run's {', '.join(cleared[:4])}{', ...' if len(cleared) > 4 else ''} "
                     "removed")
        self.tokenizer = self.data = None  # load_data: the tokenizer, the TrainingData
        self.plan, self.resumed = None, None  # load_data: the RunPlan; (path, weights, state) resumed from
        self.replicas = self.drafters = None  # load_models
        self.run = None  # train
        self.evaluating = False  # finish: while the final evaluation runs (a signal then stops it)

    def load_data(self):
        """The data stage, then the run's plan. Returns whether there are steps left to train;
        a resume of another run's checkpoint is refused here, before any model loads."""
        s, log = self.settings, self.log
        self.tokenizer = load_tokenizer(s.target_model)
        self.data = data = prepare_data(s, self.tokenizer, helpers.text_config(s.target_config).vocab_size, log)
        if s.init_drafter:
            check_init_drafter(s, data.mask_token_id)
        W = len(s.drafter_devices) * self.cluster.world_size
        self.resumed = find_checkpoint(s.resume, s.output_dir, log) if s.resume else None
        if s.resume and self.resumed is None:
            log("resume: no checkpoint in --output-dir yet; starting fresh")
        state = self.resumed[2] if self.resumed else None
        self.plan = plan = plan_run(s, defining_settings(s, data), data.batches, W, state, log)
        if self.resumed:
            log(f"resume: {self.resumed[0]} at step {plan.start_step}, batch {plan.start_cursor}")
            log.drop_records_after(plan.start_step)
        self.cluster.check_same("[step to resume from, total steps, batches per epoch, batch cursor]",
                                [plan.start_step, plan.total_steps, data.batches.batches_per_epoch, plan.start_cursor])
        if self.cluster.world_size > 1:
            log(f"machines: this is {self.cluster.rank} of {self.cluster.world_size} (pid {os.getpid()}); "
                f"{W} drafter workers in all")
        log(f"layout: target {[str(d) for d in s.target_devices]} | "
            f"drafter workers {[str(d) for d in s.drafter_devices]}")
        log(f"batches: {s.rows_per_batch} x {s.max_length} = {s.token_budget} tokens, "
            f"{s.num_anchors * s.rows_per_batch} anchors x block {s.block_size}; packing efficiency "
            f"{data.batches.packing_efficiency:.1%}; {data.batches.batches_per_epoch} batches/epoch; "
            f"{plan.total_steps} steps ({plan.schedule['warmup_batches'] // W} warmup, lr decay over the last "
            f"{plan.schedule['decay_batches'] // W})")
        if plan.start_step >= plan.total_steps:
            log(f"nothing to do: already at step {plan.start_step} of {plan.total_steps}")
            if self.resumed and self.cluster.is_main and not final_is_whole(s.output_dir):
                drafter = dm.DFlashDraftModel(dm.DFlashDraftModel.read_config(self.resumed[0]))
                drafter.load_state_dict(self.resumed[1])
                log(f"final/ was missing or partial: rebuilt from {self.resumed[0]} at "
                    f"{save_final(s.output_dir, drafter, plan.defining)}")
            return False
        return True

    def load_models(self):
        """The target stage's replicas and the drafter replicas (a resumed run's weights loaded)."""
        s = self.settings
        self.replicas, embed, head = load_target_replicas(s.target_model, s.target_devices, s.target_layer_ids,
                                                          self.log, s.target_attention, s.compile_target,
                                                          s.distillation, s.target_stages, s.target_config)
        self.drafters = build_drafters(s, self.data.mask_token_id, embed, head, self.log)
        weights = self.resumed[1] if self.resumed is not None else None
        if s.init_drafter:
            from safetensors.torch import load_file
            weights = load_file(os.path.join(s.init_drafter, "model.safetensors"))
            self.log(f"drafter: starting from {s.init_drafter}")
        if weights is not None:
            for d in self.drafters:
                d.load_state_dict(weights)

    def check_target(self):
        """The target stage against the model's own forward on one of the run's first batches (its
        dtype, attention path and stages): a target the stage does not compute exactly is refused
        here, before any step. Returns {target layer: largest relative error}."""
        t0 = time.perf_counter()
        batch = packed_batch(self.data.batches, self.plan.start_cursor)
        errors = check_against_transformers(self.replicas[0], batch)
        docs = max(len(set(row.tolist()) - {-1}) for row in batch["doc_ids"])
        self.log(f"target check: the stage's features of a packed row of {docs} documents against the model's own "
                 f"forward of each document alone, largest relative error per layer {fmt_errors(errors)} (limit "
                 f"{tolerance(self.replicas[0].dtype):g}), in {time.perf_counter() - t0:.1f}s"
                 + ("" if docs > 1 else "; no row of the first batches packs two documents, so the check saw no "
                    "document boundary"))
        return errors

    def train(self, show_progress=True):
        """Warm-up, capture and every step of the plan (or until a signal or an error)."""
        s, first_machine = self.settings, self.cluster.is_main
        prompts = heldout_prompts(s, self.tokenizer, s.eval_prompts) if s.eval_interval and first_machine else []
        if s.eval_interval and first_machine and not prompts:
            self.log("eval: --eval-interval needs held-out prompts (--eval-data); none, so no evaluation")
        validation = self.data.validation if first_machine else []
        held_out = HeldOut(s, validation, self.tokenizer, prompts, cuda_devices(s), self.log)
        self.run = Run(s, self.plan, self.data.batches, self.drafters, self.log, held_out, self.cluster)
        return run_pipeline(self.run, self.replicas, self.resumed[2]["optimizer"] if self.resumed else None,
                            show_progress)

    def finish(self):
        """After train: the errors reported, or the last checkpoint and the final drafter saved,
        evaluated on held-out prompts (checked lossless) and plotted. Returns the exit code. A
        signal meanwhile never stops the saving; it skips the evaluation, or stops it where it is."""
        def on_signal(signum):
            self.run.interrupted = True
            if self.evaluating:
                raise KeyboardInterrupt  # in the main thread, inside the evaluation's decoding
            self.log(f"signal {signum}: finishing: the checkpoint and the final drafter are saved, the evaluation "
                     "is skipped")
        with signals_handled(on_signal):
            return self.finish_run()

    def finish_run(self):
        s, run, log = self.settings, self.run, self.log
        if run.errors:
            for where, tb in run.errors:
                print(f"\nerror in {where}:\n{tb}", file=sys.stderr)
            log(f"stopped after an error; checkpoints in {s.output_dir}/checkpoints are untouched")
            return 1
        final_step = run.workers[0].steps_done
        run.check_finite(final_step)
        if final_step == self.plan.start_step:  # stopped before its first step: nothing new to save
            log(f"stopped before step {self.plan.start_step + 1}; nothing saved")
            return 0
        if not self.cluster.is_main:
            log(f"done: {final_step} steps; the first machine saves the drafter")
            return 0
        if final_step not in checkpoint_steps(s.output_dir):  # interrupted between saves
            run.save(final_step)
        final_dir = save_final(s.output_dir, run.workers[0].drafter, self.plan.defining)
        for line in self.data.corpus.stats.summary():
            log(f"data: {line.strip()}")
        log(f"done: {final_step} steps; drafter saved to {final_dir}")
        self.replicas = None  # the target stage's GPU memory goes to the evaluation's whole target
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        report = None
        if not run.interrupted and s.eval_prompts > 0:
            self.evaluating = True
            try:
                report = self.evaluate_final(final_dir)
            except KeyboardInterrupt:
                log(f"signal: the evaluation stopped where it was; the drafter is saved in {final_dir}")
            finally:
                self.evaluating = False
        write_plots(s.output_dir, log)
        if report is not None and not report["lossless"]:
            wrong = [m for m in report["mismatches"] if not m["near_tie"]]
            log(f"FAILED: {len(wrong)} speculative outputs differ from the target's greedy ones beyond rounding "
                f"(a decoding bug: the acceptance figures are not to be trusted): {wrong[:3]}")
            return 1
        return 0

    def close(self):
        """The output directory's lock released (the process's end releases it too)."""
        if self.lock is not None:
            self.lock.release()

    def evaluate_final(self, final_dir):
        """Measured acceptance length of the final drafter on held-out prompts: real speculative
        decoding against the target, checked lossless."""
        s, log = self.settings, self.log
        prompts = heldout_prompts(s, self.tokenizer, s.eval_prompts)
        if not prompts:
            log("eval: no held-out prompts available")
            return None
        target = self.run.held_out.full_target()
        report = evaluate_drafter_dir(s.target_model, final_dir, prompts, next(target.parameters()).device,
                                      s.eval_max_new_tokens, s.chat_template_kwargs, log=log, target=target,
                                      prompt_files=[heldout_prompts_file(s)], temperature=s.eval_temperature,
                                      seed=s.seed)
        log(f"eval: acceptance length {report['acceptance_length']:.2f} (prompt lookup "
            f"{report['prompt_lookup_acceptance_length']:.2f}) on {report['answers']} held-out answers; "
            f"{speedup_text(report)}; "
            f"outputs identical to target greedy: {report['lossless']}; report {final_dir}/eval_acceptance.json")
        return report


# -----------------------------------------------------------------------------
# Main

def train(settings):
    cluster = Cluster.from_env(settings.drafter_devices, settings.dist_timeout)
    trainer = Trainer(settings, cluster)
    rc = 0
    try:
        if trainer.load_data():
            trainer.load_models()
            trainer.check_target()
            trainer.train()
            rc = trainer.finish()
    finally:
        trainer.close()
    if rc == 0:  # after a failure a collective may still wait in a worker thread: exiting tears it down
        cluster.close()
    return rc


def main(argv=None):
    try:
        settings = resolve_settings(parse_flags(argv))
        if settings.plan:
            plan = memory_plan(settings)
            fits, verdict = plan_verdict(settings, plan)
            print(plan_text(plan, settings) + "\n" + verdict)
            return 0 if fits else 1
        return train(settings)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a signal while the data or the models load (the steps stop at a step, and save)
        print("interrupted before the first step; nothing was saved", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

