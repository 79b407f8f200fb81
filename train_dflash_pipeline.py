"""Train a DFlash drafter: the frozen target runs in the main thread, drafters train in worker threads.

    command line -> Settings (checked and resolved once, frozen)
      -> data stage (chat_data.py: rows -> documents -> tokenised corpus, cached) -> fixed-shape packed batches
      -> target stage (main thread, one replica per target device, only the layers needed)
      -> bounded queue per drafter worker (the target's hidden states already on the worker's device)
      -> drafter workers (one thread per drafter device: step, gradient averaging, AdamW);
         several machines under torchrun: one such process each, gradients averaged over all
      -> checkpoints (servable drafter + training state) and the run's log (train.log, metrics.jsonl, tqdm)

Every batch has the same shape ([rows, max_length], rows = token_budget // max_length) so the
drafter step can be compiled and captured as one CUDA graph (--compile). Read top to bottom in
that order; Trainer at the end runs the stages, main() the command line. docs/architecture.md
has the threads, streams and queues, and why each design choice.
"""

import argparse
import contextlib
import copy
import dataclasses
import errno
import fcntl
import gc
import glob
import hashlib
import itertools
import json
import math
import os
import queue
import re
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
import collections

import numpy as np
import torch

import dflash_model as dm
from chat_data import UsageError, load_corpus, parse_chat_template_kwargs, parse_data_fields, render_chat, \
    resolve_data_paths, special_token_ids
from decoding import token_probs
from demo_assets import BUILTIN_DATA, BUILTIN_MODEL, BUILTIN_REGENERATED
from evaluation import accepted_lengths_everywhere, drafter_target_mismatches, evaluate_drafter_dir, evaluate_models, \
    has_heldout_prompts, heldout_prompts, heldout_prompts_file, replayed_over_answers
from flat_adamw import FlatAdamW, GradInto, WeightGradsIntoBuffer, flat_views
from plots import write_plots
from regeneration import regenerated_builtin_data
from target_model import attention_implementation, collect_layer_outputs, decoder_layers, generation_config_of, \
    load_full_target, load_tokenizer, register_flex_attention, resolve_model_path, stop_token_ids, \
    target_flex_kernel_options, target_windows

# -----------------------------------------------------------------------------
# Command line

DEFAULT_MODEL, DEFAULT_DATA = BUILTIN_MODEL, BUILTIN_DATA


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--target-model", default=DEFAULT_MODEL, help="transformers model id or local directory (decoder-only causal LM)")
    a("--data", nargs="+", default=[DEFAULT_DATA],
      help="data files or globs: JSONL, a JSON array (.json), Parquet (.parquet; pyarrow), or a directory saved by "
      "datasets' save_to_disk; rows of messages, conversations, or input_ids+loss_mask; built in: builtin:sharegpt "
      "(human replies), builtin:sharegpt-regenerated (every built-in prompt answered by the built-in target, "
      "regenerated once on a GPU: the GPU demo's data)")
    a("--data-fields", default=None,
      help="the data's names for the fields read, e.g. 'messages=conversation' (NAME=FIELD, comma-separated; NAME "
      "one of messages, conversations, input_ids, loss_mask)")
    a("--data-workers", type=int, default=0,
      help="processes that render and tokenise the data (0: one per CPU core, at most 32); the result is the same")
    a("--output-dir", default="runs/dflash", help="logs, metrics.jsonl and checkpoints go here")
    a("--target-gpus", default=None, help="e.g. 0,1,2,3,4,5 (or cpu); default: chosen from the visible GPUs")
    a("--drafter-gpus", default=None, help="one drafter worker thread per entry, e.g. 6,7 (repeats and cpu allowed)")
    a("--shard-optimizer", action=argparse.BooleanOptionalAction, default=None,
      help="each drafter worker of this machine keeps and updates the AdamW moments of its share of the drafter's "
      "parameters alone (a large drafter's state split over the drafter GPUs; the same training); default: on "
      "where the memory plan needs it")
    a("--target-stages", type=int, default=1,
      help="decoder-layer stages per target replica, each on the next of --target-gpus (a GPU may repeat): a target "
      "larger than one GPU splits over K of them; the target GPUs hold (their count / K) replicas")
    a("--token-budget", type=int, default=12288,
      help="tokens per fixed-shape batch (a multiple of --max-length); 4 x 3072 fits an H200 at Qwen3-8B shapes")
    a("--max-length", type=int, default=3072, help="longest sequence; also the row length of a batch")
    a("--block-size", type=int, default=16)
    a("--num-anchors", type=int, default=512, help="anchors per --max-length tokens (per batch row)")
    a("--num-draft-layers", type=int, default=5)
    a("--target-layer-ids", default=None, help="comma list; default: evenly spread over the target")
    a("--mask-token-id", type=int, default=None,
      help="default: an embedding row the tokenizer never uses, else an unused reserved special token")
    a("--chat-template-kwargs", default=None,
      help='JSON options for the chat template, e.g. \'{"enable_thinking": false}\': the ones the server will use; '
      "recorded in the drafter directory")
    a("--lr", type=float, default=6e-4)
    a("--warmup-ratio", type=float, default=0.04)
    a("--decay-ratio", type=float, default=1.0,
      help="share of the run's steps over which the learning rate falls (cosine) to zero at the end; "
      "until then it holds at --lr after the warm-up. 1.0: cosine over the whole run after the warm-up")
    a("--weight-decay", type=float, default=0.0)
    a("--epochs", type=float, default=6)
    a("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    a("--grad-clip", type=float, default=1.0)
    a("--loss-decay-gamma", type=float, default=None,
      help="slot k's loss weight is exp(-(k - 1) / gamma); default: 7 for block 16, 5 for 10, 4 for 8 "
      "(the GPU demo: 3)")
    a("--ce-chunk-size", type=int, default=4096, help="draft positions per LM-head/CE chunk (bounds logits memory)")
    a("--loss", choices=("ce", "kl", "mix"), default="ce",
      help="the drafter's loss per block slot: ce (cross-entropy on the data's token), kl (KL divergence from the "
      "target's own next-token distribution, which the target stage computes) or mix ((1 - w) ce + w kl, "
      "w = --kl-weight)")
    a("--kl-weight", type=float, default=0.5, help="--loss mix: the KL's share of the loss, in (0, 1)")
    a("--distill-temperature", type=float, default=1.0,
      help="--loss kl/mix: the temperature of the target distribution the drafter learns")
    a("--distill-top-k", type=int, default=64,
      help="--loss kl/mix: the target's distribution travels as its k most likely tokens and the rest of its mass "
      "as one bucket (8 bytes per token each)")
    a("--seed", type=int, default=0)
    a("--log-interval", type=int, default=10)
    a("--save-interval", type=int, default=1000)
    a("--keep-checkpoints", type=int, default=3, help="this run's newest checkpoints kept (at least 1)")
    a("--resume", default=None, help="a checkpoint directory, or 'auto' for the latest in --output-dir")
    a("--overwrite", action="store_true",
      help="start afresh in an --output-dir that holds another run: its checkpoints, final/ and metrics go first")
    a("--resume-anyway", action="store_true",
      help="resume even where the checkpoint was made with other data or settings (said in the log)")
    a("--init-drafter", default=None,
      help="start from this drafter directory (this tool's final/ or a released DFlash drafter) on new data, with a "
      "fresh optimizer and schedule; it must fit the target and these settings (checked, each difference named)")
    a("--compile", action="store_true", help="compile each drafter step and replay it as one CUDA graph")
    a("--target-attention", choices=("auto", "dense", "flex"), default="auto",
      help="the target stage's attention over packed documents: dense (transformers' SDPA under an [R, 1, L, L] "
      "mask) or flex (flex_attention under a document BlockMask: masked tiles skipped; same features); "
      "auto: flex on GPUs, dense on CPU")
    a("--drafter-attention", choices=("auto", "triton", "flex", "sdpa"), default="auto",
      help="the drafter's block attention in training: triton (dflash_model's kernels, over exactly the keys each "
      "block sees), flex (flex_attention under a block mask) or sdpa (a dense mask; CPU); auto: triton on Hopper "
      "GPUs where its shapes fit (else flex), sdpa on CPU")
    a("--compile-target", action=argparse.BooleanOptionalAction, default=None,
      help="compile the target's decoder layers (inductor) before the stage is warmed up (and, with --compile, "
      "captured); same features. Default: on with --compile on GPUs")
    a("--plan", action="store_true",
      help="print the memory plan (what each GPU will hold: weights, optimizer state, activations) from the configs "
      "alone and exit, nothing loaded")
    a("--gpu-memory", type=float, default=None,
      help="GB each GPU holds, for the memory plan: plan for GPUs this machine does not have (with --plan: any "
      "--target-gpus/--drafter-gpus indices)")
    a("--queue-depth", type=int, default=2, help="batches waiting per drafter worker")
    a("--switch-interval", type=float, default=1e-4,
      help="Python thread switch interval (s) on GPU runs: short, so workers are not kept waiting")
    a("--dist-timeout", type=float, default=1800,
      help="several machines (torchrun): seconds a machine waits for the others before the run stops")
    a("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "dflash_train"))
    a("--eval-data", default=None, help="held-out prompts (JSONL) for the final acceptance-length measurement; "
      "default with the built-in target: the 80 MT-Bench questions")
    a("--eval-interval", type=int, default=0,
      help="every N steps, measure the real acceptance length on the held-out prompts and log it next to tau_hat; "
      "and the loss, accuracy and tau_hat of the validation documents (else those at the end only)")
    a("--val-interval", type=int, default=200,
      help="every N steps, the loss, accuracy and tau_hat of the validation documents (0: at the end and at "
      "--eval-interval steps only)")
    a("--val-fraction", type=float, default=0.01, help="share of the documents held out for validation")
    a("--val-rows", type=int, default=16, help="validation rows of --max-length evaluated each time")
    a("--eval-prompts", type=int, default=8, help="how many held-out prompts to evaluate at the end (0: none)")
    a("--eval-max-new-tokens", type=int, default=64)
    a("--eval-turns", type=int, default=1, help="turns of each multi-turn held-out prompt to evaluate")
    a("--eval-temperature", type=float, default=0.0,
      help="also measure the acceptance length at this sampling temperature (speculative sampling), beside greedy: "
      "in the final evaluation and at --eval-interval steps")
    a("--regen-max-new-tokens", type=int, default=512, help="GPU demo: longest regenerated reply")
    a("--regen-batch-size", type=int, default=1024,
      help="GPU demo: rows the target decodes together while regenerating (fewer where the KV cache would not fit)")
    a("--regen-attention", choices=["grouped", "flex"], default="grouped",
      help="GPU demo: the regeneration's decode attention (see scripts/regenerate_data.py --attention)")
    return p


# The built-in demo (no arguments): a real 135M chat model and real conversations, sized to
# finish on a laptop CPU in minutes. Typed flags still win.
DEMO_DEFAULTS = dict(max_length=256, token_budget=1024, num_anchors=16, num_draft_layers=2, lr=1e-3,
                     max_steps=60, log_interval=5, save_interval=30, output_dir="runs/demo", eval_prompts=6,
                     eval_max_new_tokens=48)
# On a GPU the demo is the whole recipe: regenerate every built-in conversation with the target,
# train with --compile for a fixed 6,000 steps (about 9 minutes on one H200, whatever the data
# holds), evaluate on the 80 MT-Bench questions (both turns) against prompt lookup. Where its
# settings differ from the 8B recipe (lr, the peak held until the last 20%, loss gamma 3: a
# drafter this weak seldom reaches its late slots) they measured better on this target; anchors,
# block size and draft layers stay the 8B recipe's, as nothing tried beat them at equal steps or
# minutes: docs/recipe.md.
GPU_DEMO_DEFAULTS = dict(data=[BUILTIN_REGENERATED], max_length=2048, token_budget=16384, num_anchors=512,
                         num_draft_layers=5, lr=1e-3, decay_ratio=0.2, loss_decay_gamma=3.0, max_steps=6000,
                         log_interval=50, save_interval=1000, output_dir="runs/demo-gpu", eval_prompts=80,
                         eval_turns=2, eval_max_new_tokens=256, compile=True, regen_max_new_tokens=256)


def parse_flags(argv=None, parser=None):
    """The command line's flags. With the built-in model the demo's sizes are the defaults: a flag
    typed on the command line wins, even where it equals the default."""
    parser = parser or build_parser()
    flags = parser.parse_args(argv)
    if flags.target_model == DEFAULT_MODEL:
        parser.set_defaults(**(GPU_DEMO_DEFAULTS if torch.cuda.is_available() else DEMO_DEFAULTS))
        flags = parser.parse_args(argv)
    return flags


# -----------------------------------------------------------------------------
# Settings: the flags checked and resolved once, before any model loads, then frozen

class Settings(argparse.Namespace):
    """Every flag (build_parser names them), with these resolved from the flags and the machine
    (resolve_settings):

      token_budget       rounded down to a multiple of max_length
      rows_per_batch     token_budget // max_length
      chat_template_kwargs  a dict
      data_fields        {the name read: the data's name} (--data-fields)
      target_devices, drafter_devices  lists of torch.device (the layout)
      target_layer_ids   the target layers whose outputs the drafter reads, a list of ints (the flag's
                         list, or the default)
      loss_decay_gamma   a number (the flag, or the published value for the block size)
      distillation       None (--loss ce), or {kl_weight, temperature, top_k}: the target's
                         distribution the loss reads (--loss kl: kl_weight 1)
      drafter_attention  triton, flex or sdpa (auto resolved for the devices and shapes)
      target_attention   dense or flex (auto resolved)
      compile_target     a bool

    and two that the data stage adds (Trainer.load_data), once the data is read:

      data_files         the data's files (built-in names and globs resolved)
      mask_token_id      the id that fills block slots 1.. (the flag's, or one the data never uses)

    Frozen: a stage that derives a value makes a new Settings (replace), never changes one."""

    def __init__(self, **values):
        for key, value in values.items():
            object.__setattr__(self, key, value)

    def __setattr__(self, key, value):
        raise AttributeError(f"settings are frozen: {key} is set once, by resolve_settings (or replace)")

    __delattr__ = __setattr__

    def replace(self, **changes):
        return Settings(**{**vars(self), **changes})

    @classmethod
    def of_flags(cls, argv, **resolved):
        """Settings of the given flags, checked, with the resolved values given (the ones the
        machine and target would give are not looked up): for building one stage alone."""
        flags = build_parser().parse_args(argv)
        check_flags(flags)
        return cls(**vars(flags)).replace(**derived_from_flags(flags, quiet=True), **resolved)


def derived_from_flags(flags, quiet=False):
    """The values resolved from the flags alone: the rounded token budget, rows per batch, the
    chat-template options and data field names parsed, the loss gamma and the distillation."""
    budget = rounded_token_budget(flags, quiet)
    distillation = None if flags.loss == "ce" else dict(
        kl_weight=1.0 if flags.loss == "kl" else flags.kl_weight, temperature=flags.distill_temperature,
        top_k=flags.distill_top_k)
    return dict(token_budget=budget, rows_per_batch=budget // flags.max_length,
                chat_template_kwargs=parse_chat_template_kwargs(flags.chat_template_kwargs),
                data_fields=parse_data_fields(flags.data_fields),
                loss_decay_gamma=flags.loss_decay_gamma or dm.default_loss_gamma(flags.block_size),
                distillation=distillation)


def check_flags(flags):
    """Ranges of the flags alone (a sentence naming the flag for each), before anything loads."""
    if BUILTIN_REGENERATED in flags.data and (flags.target_model != BUILTIN_MODEL or not torch.cuda.is_available()):
        raise UsageError(f"--data {BUILTIN_REGENERATED} is written by the built-in target ({BUILTIN_MODEL}) on a GPU; "
                         "elsewhere regenerate with scripts/regenerate_data.py")
    if flags.max_length < 2:
        raise UsageError("--max-length must be at least 2")
    if flags.token_budget < flags.max_length:
        raise UsageError(f"--token-budget {flags.token_budget} is smaller than --max-length {flags.max_length}: "
                         f"a batch must hold one whole sequence; use --token-budget >= {flags.max_length}")
    if not 2 <= flags.block_size < flags.max_length:
        raise UsageError(f"--block-size {flags.block_size} does not fit: it must be in [2, --max-length)")
    if not 1 <= flags.num_anchors < flags.max_length:
        raise UsageError(f"--num-anchors {flags.num_anchors} must be in [1, --max-length={flags.max_length})")
    if flags.data_workers < 0:
        raise UsageError(f"--data-workers {flags.data_workers} must be 0 (one per CPU core) or more")
    if flags.eval_temperature < 0:
        raise UsageError(f"--eval-temperature {flags.eval_temperature} must be 0 (greedy alone) or more")
    if flags.loss == "mix" and not 0 < flags.kl_weight < 1:
        raise UsageError(f"--kl-weight {flags.kl_weight} must be in (0, 1) (--loss ce or kl for the ends)")
    if flags.distill_temperature <= 0:
        raise UsageError(f"--distill-temperature {flags.distill_temperature} must be positive")
    if flags.distill_top_k < 1:
        raise UsageError(f"--distill-top-k {flags.distill_top_k} must be at least 1")
    if not 0 < flags.decay_ratio <= 1:
        raise UsageError(f"--decay-ratio {flags.decay_ratio} must be in (0, 1]")
    # grad_clip 0 would scale every update to nothing
    for name in ("lr", "epochs", "log_interval", "save_interval", "queue_depth", "ce_chunk_size", "regen_batch_size",
                 "grad_clip", "num_draft_layers", "eval_max_new_tokens", "eval_turns", "regen_max_new_tokens",
                 "switch_interval", "dist_timeout", "keep_checkpoints"):
        if getattr(flags, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(flags, name)} must be positive")
    if flags.max_steps is not None and flags.max_steps < 1:
        raise UsageError(f"--max-steps {flags.max_steps} must be at least 1 (leave it out to train --epochs)")
    for name in ("weight_decay", "eval_prompts", "eval_interval", "val_interval", "val_rows"):
        if getattr(flags, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(flags, name)} must be 0 or more")
    for name in ("warmup_ratio", "val_fraction"):
        if not 0 <= getattr(flags, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(flags, name)} must be in [0, 1)")
    if flags.init_drafter and flags.resume:
        raise UsageError("--init-drafter starts a new run from a drafter, --resume continues a run: give one of them")
    if flags.init_drafter and not os.path.exists(os.path.join(flags.init_drafter, "config.json")):
        raise UsageError(f"--init-drafter {flags.init_drafter}: not a drafter directory (no config.json)")
    if flags.resume and flags.overwrite:
        raise UsageError("--resume continues the run in --output-dir, --overwrite replaces it: give one of them")


def rounded_token_budget(flags, quiet=False):
    """--token-budget rounded down to a multiple of --max-length (said, where it changes)."""
    budget = flags.token_budget // flags.max_length * flags.max_length
    if budget != flags.token_budget and not quiet:
        print(f"note: --token-budget {flags.token_budget} rounded down to {budget} (a multiple of --max-length)")
    return budget


def parse_devices(spec):
    out = []
    for tok in spec.split(","):
        tok = tok.strip()
        if tok == "cpu":
            out.append(torch.device("cpu"))
        elif tok.isdigit():
            out.append(torch.device("cuda", int(tok)))
        elif tok:
            raise UsageError(f"device '{tok}' in '{spec}' is neither a GPU index nor 'cpu'")
    return out


def resolve_layout(flags):
    """(target devices, drafter devices). Defaults: 8 GPUs 6+2; 2 GPUs 1+1; 1 GPU shared; none: CPU."""
    n = torch.cuda.device_count()
    if flags.target_gpus is None and flags.drafter_gpus is None:
        if n == 0:
            return [torch.device("cpu")], [torch.device("cpu")]
        if n == 1:
            return [torch.device("cuda", 0)], [torch.device("cuda", 0)]
        nd = max(1, n // 4)
        return [torch.device("cuda", i) for i in range(n - nd)], [torch.device("cuda", i) for i in range(n - nd, n)]
    if flags.target_gpus is None or flags.drafter_gpus is None:
        raise UsageError("give both --target-gpus and --drafter-gpus, or neither")
    targets, drafters = parse_devices(flags.target_gpus), parse_devices(flags.drafter_gpus)
    if not targets or not drafters:
        raise UsageError("--target-gpus and --drafter-gpus each need at least one device")
    for d in targets + drafters:
        if d.type == "cuda" and d.index >= n and not (flags.plan and flags.gpu_memory):
            raise UsageError(f"GPU {d.index} does not exist: {n} GPU(s) visible "
                             f"(indices 0..{n - 1}; CUDA_VISIBLE_DEVICES renumbers them)")
    return targets, drafters


def unsupported_target_features(tc):
    """What a target's attention does that the target stage's masks and kernels do not compute
    (so its hidden states would differ from the model's): named, for a refusal at start-up."""
    out = []
    if getattr(tc, "attn_logit_softcapping", None):
        out.append("attention logit soft-capping (Gemma 2)")
    if tc.model_type == "gpt_oss":
        out.append("attention sinks (gpt-oss)")
    if "linear_attention" in (getattr(tc, "layer_types", None) or []):
        out.append("linear-attention layers, which cannot keep packed documents apart (Qwen3-Next)")
    return out


def check_target_config(config, name):
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING
    tc = dm.text_config(config)
    if getattr(config, "is_encoder_decoder", False) or type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UsageError(f"--target-model {name} ({type(config).__name__}) is not a decoder-only causal LM")
    if not hasattr(tc, "num_hidden_layers") or not hasattr(tc, "hidden_size"):
        raise UsageError(f"--target-model {name}: config has no num_hidden_layers/hidden_size")
    unsupported = unsupported_target_features(tc)
    if unsupported:
        raise UsageError(f"--target-model {name}: the target stage does not compute {'; '.join(unsupported)}: its "
                         "hidden states would not be the model's, so this target is refused")


def target_config(name):
    """The target's transformers config, checked: a decoder-only causal LM."""
    from transformers import AutoConfig
    path = resolve_model_path(name)
    if os.path.sep in name and not os.path.isdir(path):
        raise UsageError(f"--target-model {name}: no such directory")
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise UsageError(f"--target-model {name}: its config cannot be read ({str(e).splitlines()[0][:200]})") from None
    check_target_config(config, name)
    return config


def resolve_drafter_attention(choice, devices, tc, block_size):
    """The drafter's training attention: --drafter-attention's choice, auto resolved for the
    devices and shapes. On Hopper GPUs (where their settings were chosen) the Triton kernels make
    the step faster than flex_attention (docs/benchmarks.md) where they fit the shapes; flex on
    other GPUs; SDPA on CPU."""
    gpu = devices[0].type == "cuda"
    fits = gpu and dm.block_attention_fits(*dm.attention_shape(tc), block_size)
    if choice == "triton" and not fits:
        raise UsageError("--drafter-attention triton needs CUDA drafter GPUs, the triton package, head_dim a power "
                         "of two from 16 to 128 and at most 128 query heads x block slots per KV head")
    if choice != "auto":
        return choice
    if not gpu:
        return "sdpa"
    return "triton" if fits and all(dm.hopper(d) for d in devices) else "flex"


def resolve_target_stage(flags, devices):
    """(target attention, compile the target's layers) as --target-attention and --compile-target
    say, their defaults resolved for the devices. flex_attention and inductor pay off on GPUs
    (docs/benchmarks.md); on CPU their eager and compiled forms are slower than SDPA."""
    gpu = devices[0].type == "cuda"
    attention = flags.target_attention if flags.target_attention != "auto" else ("flex" if gpu else "dense")
    compile_layers = flags.compile_target if flags.compile_target is not None else bool(flags.compile and gpu)
    return attention, compile_layers


def resolve_settings(flags):
    """Settings from the command line's flags: every flag checked, the layout, target layers,
    attention paths and derived sizes resolved, before any model loads (the target's config is
    read, not its weights)."""
    check_flags(flags)
    target_devices, drafter_devices = resolve_layout(flags)
    if flags.compile and any(d.type != "cuda" for d in drafter_devices):
        raise UsageError("--compile captures CUDA graphs and needs GPU drafter devices; drop it on CPU")
    config = target_config(flags.target_model)
    tc = dm.text_config(config)
    if flags.loss != "ce" and flags.distill_top_k > tc.vocab_size:
        raise UsageError(f"--distill-top-k {flags.distill_top_k} is larger than the target's vocabulary "
                         f"({tc.vocab_size})")
    try:
        layer_ids = ([int(x) for x in flags.target_layer_ids.split(",")] if flags.target_layer_ids
                     else dm.default_target_layer_ids(tc.num_hidden_layers, flags.num_draft_layers))
        dm.check_target_layer_ids(layer_ids, tc.num_hidden_layers)
        if flags.target_layer_ids and len(set(layer_ids)) != len(layer_ids):
            raise ValueError("each layer once: a repeated layer adds nothing the drafter could use")
    except ValueError as e:
        raise UsageError(f"--target-layer-ids {flags.target_layer_ids}: {e}") from None
    if flags.target_stages < 1 or len(target_devices) % flags.target_stages:
        raise UsageError(f"--target-stages {flags.target_stages}: each replica takes that many of the "
                         f"{len(target_devices)} target devices, which it must divide (a GPU may repeat in "
                         "--target-gpus: '0,0' is two stages on GPU 0)")
    stage_bounds(layers_run(tc.num_hidden_layers, layer_ids, flags.loss != "ce"), flags.target_stages)  # checked
    target_attention, compile_target = resolve_target_stage(flags, target_devices)
    # planning for GPUs this machine lacks (--plan --gpu-memory): their kind is unknown, and the
    # plan does not depend on the drafter's attention kernel
    elsewhere = flags.plan and flags.gpu_memory and any(d.type == "cuda" for d in drafter_devices)
    drafter_attention = "flex" if elsewhere else \
        resolve_drafter_attention(flags.drafter_attention, drafter_devices, tc, flags.block_size)
    return Settings(**vars(flags)).replace(
        **derived_from_flags(flags), target_devices=target_devices, drafter_devices=drafter_devices,
        target_layer_ids=layer_ids, drafter_attention=drafter_attention,
        target_attention=target_attention, compile_target=compile_target, data_files=None)


# -----------------------------------------------------------------------------
# The memory plan: what each GPU will hold, from the configs alone (the meta device), before any
# weight loads. Weights and optimizer state are exact counts; activations are estimates from the
# shapes (the largest live set of the target's forward; what the drafter step keeps for its
# backward), and the warm-up measures the real step before the run (budget_error).

GB = 2**30
# a plan's parts; the activations are estimates, the rest exact counts
TARGET_WEIGHTS, TARGET_ACTIVATIONS = "target weights", "target activations (estimate)"
DRAFTER_STATE, FROZEN_PARTS = "drafter weights, gradient and AdamW state", "frozen embedding and LM head"
DRAFTER_ACTIVATIONS = "drafter step activations (estimate)"
ESTIMATED = (TARGET_ACTIVATIONS, DRAFTER_ACTIVATIONS)


def parameter_count(module_fn):
    """Parameters of the module module_fn builds, built on the meta device (no memory)."""
    with torch.device("meta"):
        return sum(p.numel() for p in module_fn().parameters())


def layers_run(num_layers, target_layer_ids, distillation):
    """How many decoder layers the target stage runs: up to the deepest the drafter reads; all of
    them with a distillation, whose distribution is the LM head's."""
    return num_layers if distillation else max(target_layer_ids) + 1


TARGET_PARTS = {}  # target_parts' counts by config (as JSON): a meta build of a large model takes seconds


def target_parts(config):
    """Parameter counts of the target's parts, from its config built on the meta device (once a
    config): {layers: per decoder layer, embed, rest: the base model's other parts (final norm,
    rotary tables), head: the LM head's own (0 where it is the embedding's)}."""
    key = config.to_json_string()
    if key not in TARGET_PARTS:
        from transformers import AutoModelForCausalLM
        count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        layers, embed, head = decoder_layers(model), model.get_input_embeddings(), model.get_output_embeddings()
        TARGET_PARTS[key] = {"layers": [count(layer) for layer in layers], "embed": count(embed),
                             "rest": count(getattr(model, model.base_model_prefix)) - count(layers) - count(embed),
                             "head": 0 if head.weight is embed.weight else count(head)}
    return TARGET_PARTS[key]


def stage_parameters(parts, keep_layers, stages, lm_head):
    """The parameters each stage of a replica holds (target_parts' first keep_layers decoder
    layers split in `stages`, stage_bounds): its layers; every one the base model's small parts
    it runs; the first also the embedding; the last the LM head if lm_head."""
    bounds = stage_bounds(keep_layers, stages)
    return [sum(parts["layers"][a:b]) + parts["rest"] + (parts["embed"] if k == 0 else 0)
            + (parts["head"] if lm_head and k == stages - 1 else 0) for k, (a, b) in enumerate(zip(bounds, bounds[1:]))]


def memory_plan(settings, config):
    """{device: {part: bytes}} for every GPU of the layout (a device shared by both stages holds
    both). Bytes: bf16 target weights; the drafter's fp32 master weights, bf16 copy and gradient
    and AdamW's two fp32 moments (16 bytes a parameter), the frozen embedding and LM head copies;
    activations at the token budget."""
    tc = dm.text_config(config)
    s = settings
    H, I, V = tc.hidden_size, tc.intermediate_size, tc.vocab_size
    heads, kv_heads, head_dim = dm.attention_shape(tc)
    T, R, L = s.token_budget, s.rows_per_batch, s.max_length
    n = len(s.target_layer_ids)
    keep = layers_run(tc.num_hidden_layers, s.target_layer_ids, s.distillation is not None)
    plan = collections.defaultdict(collections.Counter)  # a device listed twice holds its parts twice

    stage_weights = [2 * p for p in stage_parameters(target_parts(config), keep, s.target_stages,
                                                     s.distillation is not None)]
    # one layer's live set at a time, plus the captured layers' outputs and their concatenation
    target_act = 2 * T * (2 * n * H + 3 * H + (heads + 2 * kv_heads) * head_dim + 3 * I)
    if s.target_attention == "dense":
        target_act += 2 * R * L * L  # the additive document mask
    if s.distillation is not None:  # the LM head a chunk of positions at a time, then the top k
        target_act += 3 * 4 * min(T, 4096) * V + 8 * T * s.distillation["top_k"]
    for i, d in enumerate(s.target_devices):  # each replica's stages on the next target devices
        if d.type == "cuda":
            plan[d][TARGET_WEIGHTS] += stage_weights[i % s.target_stages]
            plan[d][TARGET_ACTIVATIONS] += target_act
    drafter_cfg = dm.make_drafter_config(config, mask_token_id=0, num_draft_layers=s.num_draft_layers,
                                         block_size=s.block_size, target_layer_ids=s.target_layer_ids)
    drafter_params = parameter_count(lambda: dm.DFlashDraftModel(drafter_cfg))
    P = R * s.num_anchors * s.block_size  # block positions a step
    context = 2 * T * (2 * n * H + 2 * H + 4 * kv_heads * head_dim * s.num_draft_layers)
    blocks = 2 * P * s.num_draft_layers * (4 * H + 3 * heads * head_dim + 4 * kv_heads * head_dim + 3 * I)
    head = 2 * min(s.ce_chunk_size, P) * V * (3 if s.distillation is not None else 1) + 2 * P * H
    # fp32 weights, their bf16 copy and the bf16 gradient on every worker; the two fp32 moments
    # on every worker, or split over them (--shard-optimizer)
    per_param = 8 + 8 / (len(s.drafter_devices) if s.shard_optimizer else 1)
    for d in cuda_only(s.drafter_devices):
        plan[d][DRAFTER_STATE] += int(per_param * drafter_params)
        plan[d][FROZEN_PARTS] += 2 * 2 * V * H
        plan[d][DRAFTER_ACTIVATIONS] += context + blocks + head
    return dict(plan)


def gpu_capacity(settings, device):
    """Bytes a GPU holds: --gpu-memory's, else the device's own."""
    if settings.gpu_memory:
        return int(settings.gpu_memory * GB)
    return torch.cuda.get_device_properties(device).total_memory


def plan_text(plan, settings):
    lines = []
    for device, parts in sorted(plan.items(), key=lambda kv: kv[0].index):
        cap = gpu_capacity(settings, device)
        total = sum(parts.values())
        lines.append(f"{device}: {total / GB:.1f} of {cap / GB:.1f} GB" + ("" if total <= cap else "  DOES NOT FIT"))
        lines += [f"    {part}: {nbytes / GB:.2f} GB" for part, nbytes in parts.items()]
    return "\n".join(lines)


def check_memory_plan(settings, config):
    """Refuses, before anything loads, a layout whose exact parts (weights, optimizer state)
    alone do not fit a GPU, with the plan and what would fit; the activations' estimate is
    shown, and the warm-up measures them. A target the meta device cannot build is not planned
    (said), never refused for it."""
    try:
        plan = memory_plan(settings, config)
    except Exception as e:  # noqa: BLE001  (the warm-up still measures what fits)
        print(f"note: no memory plan for this target ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
        return None
    for device, parts in plan.items():
        exact = sum(b for part, b in parts.items() if part not in ESTIMATED)
        cap = gpu_capacity(settings, device)
        if exact <= cap:
            continue
        advice, s = [], settings
        keep = layers_run(dm.text_config(config).num_hidden_layers, s.target_layer_ids, s.distillation is not None)
        if parts[TARGET_WEIGHTS] > 0.9 * cap:
            parts_of = target_parts(config)
            stages = next((k for k in range(s.target_stages + 1, keep + 1)
                           if max(stage_parameters(parts_of, keep, k, s.distillation is not None)) * 2 < 0.8 * cap),
                          None)
            advice.append("the target's weights do not fit: a replica split over more GPUs "
                          f"(--target-stages {stages} with that many target GPUs a replica)" if stages else
                          "the target's weights do not fit even one layer a GPU")
        if DRAFTER_STATE in parts:
            if not s.shard_optimizer and len(s.drafter_devices) > 1:
                advice.append(f"--shard-optimizer (the AdamW moments split over the {len(s.drafter_devices)} drafter "
                              "workers)")
            advice.append("fewer draft layers (--num-draft-layers)")
        raise UsageError(f"the memory plan does not fit {device} ({exact / GB:.1f} GB of weights and optimizer state, "
                         f"{cap / GB:.1f} GB on the GPU): {'; '.join(advice)}\n{plan_text(plan, settings)}")
    return plan


def resolve_sharding(settings, config):
    """--shard-optimizer's default: on where the plan of the drafter GPUs (their activations'
    estimate included) does not fit with every worker keeping the whole optimizer state (said),
    off elsewhere: a split state costs a copy of each share to the other workers every step."""
    if settings.shard_optimizer is not None:
        return settings
    drafters = cuda_only(settings.drafter_devices)
    if len(settings.drafter_devices) < 2 or not drafters:
        return settings.replace(shard_optimizer=False)
    try:
        whole = memory_plan(settings.replace(shard_optimizer=False), config)
    except Exception:  # noqa: BLE001  (a target the meta device cannot build: check_memory_plan says so)
        return settings.replace(shard_optimizer=False)
    needed = any(sum(whole[d].values()) > gpu_capacity(settings, d) for d in drafters)
    if needed:
        print(f"note: --shard-optimizer on: the drafter GPUs' plan does not fit with the whole optimizer state on "
              f"each; the AdamW moments are split over the {len(settings.drafter_devices)} workers")
    return settings.replace(shard_optimizer=needed)


def check_evaluation_fits(settings, config):
    """The evaluations (final, --eval-interval) decode with the whole target on one device: a
    GPU of the run (the final one after the target stage has let go of its replicas; those during
    the run beside everything the plan puts there), else the host in fp32. A target that fits
    neither is refused before training, naming why, rather than failing after its last step."""
    if not (settings.eval_prompts > 0 or settings.eval_interval > 0) or not has_heldout_prompts(settings):
        return
    try:
        parts = target_parts(config)
    except Exception:  # noqa: BLE001  (a target the meta device cannot build: the evaluation finds out)
        return
    params = sum(parts["layers"]) + parts["embed"] + parts["rest"] + parts["head"]
    need = 1.25 * 2 * params + 2 * GB  # bf16 weights, with the decoder's room
    plan = memory_plan(settings, config) if cuda_devices(settings) else {}
    # what stays on a GPU while it evaluates: everything during the run; at the end the drafters
    stays = (lambda parts: sum(parts.values())) if settings.eval_interval else \
        (lambda parts: parts[DRAFTER_STATE] + parts[FROZEN_PARTS] + parts[DRAFTER_ACTIVATIONS])
    room = [gpu_capacity(settings, d) - stays(parts) for d, parts in plan.items()]
    if any(r >= need for r in room):
        return
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if 4 * params * 1.2 <= host:
        if room:
            print(f"note: the whole target ({2 * params / GB:.0f} GB in bf16) fits no GPU of the run beside what it "
                  "holds: the evaluations run on the CPU, slowly")
        return
    raise UsageError(f"the evaluations decode with the whole target on one device, and it ({2 * params / GB:.0f} GB "
                     f"in bf16, {4 * params / GB:.0f} GB in fp32 on the host) fits neither a GPU of this run nor "
                     f"this host's {host / GB:.0f} GB: pass --eval-prompts 0 and --eval-interval 0, and evaluate the "
                     "drafter with scripts/eval_acceptance.py where the target fits")


def cuda_only(devices):
    return [d for d in devices if d.type == "cuda"]


def cuda_devices(settings):
    """The run's GPUs, target and drafter, each once."""
    return sorted(set(cuda_only(settings.target_devices + settings.drafter_devices)), key=str)


def check_init_drafter(settings, target_config):
    """--init-drafter's drafter against the target and these settings: hidden size, vocabulary,
    draft layers, block size, target layers, mask token; a UsageError naming each difference
    (with the flags that would match it), before any model loads."""
    config = dm.DFlashDraftModel.read_config(settings.init_drafter)
    dflash = config.dflash_config
    wrong = drafter_target_mismatches(config, target_config)
    for name, theirs, ours, flag in (
            ("num_draft_layers", config.num_hidden_layers, settings.num_draft_layers, "--num-draft-layers"),
            ("block_size", config.block_size, settings.block_size, "--block-size"),
            ("target_layer_ids", list(dflash["target_layer_ids"]), settings.target_layer_ids, "--target-layer-ids"),
            ("mask_token_id", dflash["mask_token_id"], settings.mask_token_id, "--mask-token-id")):
        if theirs != ours:
            value = ",".join(map(str, theirs)) if isinstance(theirs, list) else theirs
            wrong.append(f"{name} {theirs} (here {ours}: pass {flag} {value})")
    if wrong:
        raise UsageError(f"--init-drafter {settings.init_drafter} does not fit: {'; '.join(wrong)}")


def used_token_ids(tokenizer, model_path, chat_template_kwargs=None):
    """Ids that text, the chat template or generation uses, special ones aside from text: bos,
    eos, pad, unk, the generation stop ids, and every special token the template emits."""
    used = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    used |= set(stop_token_ids(tokenizer, generation_config_of(model_path)))
    probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
             {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}]
    for messages in (probe, probe[1:]):
        try:
            text = render_chat(tokenizer, messages, True, chat_template_kwargs)
        except Exception:  # a template that refuses a system turn
            continue
        used |= set(tokenizer(text, add_special_tokens=False)["input_ids"]) & special_token_ids(tokenizer)
    return {int(i) for i in used if i is not None}


def choose_mask_token_id(tokenizer, vocab_size, corpus, explicit, model_path, chat_template_kwargs=None):
    """The id that fills block slots 1..: never one that text, the template or generation uses
    (used_token_ids, and every id in the corpus). Default: the first embedding row the tokenizer
    never produces (Qwen3: 151669); else an unused reserved special token (Llama 3:
    <|reserved_special_token_N|>); else an unused special token of another purpose whose name
    does not mark a boundary (SmolLM2: <repo_name>). An explicit id that is used is refused."""
    used = used_token_ids(tokenizer, resolve_model_path(model_path), chat_template_kwargs)
    used |= set(np.unique(corpus.ids).tolist())
    name = lambda i: tokenizer.convert_ids_to_tokens(int(i)) if i < len(tokenizer) else "an unused embedding row"
    if explicit is not None:
        if not 0 <= explicit < vocab_size:
            raise UsageError(f"--mask-token-id {explicit} is outside the target's vocabulary [0, {vocab_size})")
        if explicit in used:
            raise UsageError(f"--mask-token-id {explicit} ({name(explicit)!r}) is used by the text, the chat template "
                             "or generation (bos/eos/pad, a stop id, a template token or a token of the data): "
                             "the drafter would learn to read it as that; choose an unused id")
        return explicit
    if len(tokenizer) < vocab_size:
        return len(tokenizer)
    unused = sorted(i for i in special_token_ids(tokenizer) | set(getattr(tokenizer, "added_tokens_decoder", {}))
                    if i not in used and i < vocab_size)
    reserved = [i for i in unused if "reserved" in name(i).lower()]
    boundary = r"end|eos|eot|pad|stop|bos|begin|start|unk|sep|mask"
    neutral = [i for i in unused if not re.search(boundary, name(i).lower())]
    if reserved or neutral:
        return int((reserved or neutral)[0])
    raise UsageError(f"the tokenizer uses all {vocab_size} embedding rows and has no unused special token; pass "
                     "--mask-token-id (an id that never appears in text, the template or generation)")


# -----------------------------------------------------------------------------
# Data stage: the corpus (chat_data.py) -> fixed-shape packed batches, and held-out validation rows


def pack_epoch(lengths, max_length, seed, epoch, open_rows=16):
    """Shuffle documents (deterministic per epoch) and pack them into rows of max_length tokens:
    first fit among a few open rows, closing the fullest when none fits."""
    order = np.random.default_rng([seed, epoch]).permutation(len(lengths))
    rows, open_ = [], []  # open_: [used, [doc ids]]
    for d in order:
        n = int(lengths[d])
        for r in open_:
            if r[0] + n <= max_length:
                r[0] += n
                r[1].append(int(d))
                break
        else:
            if len(open_) == open_rows:
                fullest = max(range(len(open_)), key=lambda i: open_[i][0])
                rows.append(open_.pop(fullest)[1])
            open_.append([n, [int(d)]])
    rows += [r[1] for r in open_]
    return rows


def make_batch(corpus, rows, max_length):
    """Fixed-shape tensors [len(rows), max_length]: ids, loss mask, document ids (-1 = padding),
    positions (restart at 0 in each document)."""
    R = len(rows)
    ids = np.zeros((R, max_length), np.int64)
    mask = np.zeros((R, max_length), np.float32)
    doc = np.full((R, max_length), -1, np.int64)
    pos = np.zeros((R, max_length), np.int64)
    for r, docs in enumerate(rows):
        at = 0
        for j, d in enumerate(docs):
            t, m = corpus.doc(d)
            n = len(t)
            ids[r, at:at + n], mask[r, at:at + n] = t, m
            doc[r, at:at + n], pos[r, at:at + n] = j, np.arange(n)
            at += n
    t = lambda x: torch.from_numpy(x)
    return {"input_ids": t(ids), "loss_mask": t(mask), "doc_ids": t(doc), "position_ids": t(pos)}


class BatchSequence:
    """The endless, deterministic sequence of batches: epoch by epoch, rows_per_batch rows each.
    Batch k of the run is the same in every run with the same seed, whatever the worker count, so
    resuming at a cursor of k batches continues exactly. docs: the corpus's documents it draws from
    (default all; the validation documents are left out by index, the corpus is not copied)."""

    def __init__(self, corpus, rows_per_batch, max_length, seed, docs=None):
        self.corpus, self.rows_per_batch, self.max_length, self.seed = corpus, rows_per_batch, max_length, seed
        self.docs = np.arange(len(corpus)) if docs is None else np.asarray(docs)
        self.lengths = corpus.lengths[self.docs]
        first = pack_epoch(self.lengths, max_length, seed, 0)
        self.batches_per_epoch = max(1, len(first) // rows_per_batch)
        self.packing_efficiency = int(self.lengths.sum()) / (len(first) * max_length)

    def iterate(self, skip, round_size=1, mine=range(1)):
        """Batches from number `skip` on. Batch g is position (g - skip) % round_size of its step's
        round; only positions in `mine` are built (over several machines, each builds its slice)."""
        epoch, k = skip // self.batches_per_epoch, skip % self.batches_per_epoch
        while True:
            rows = [[int(self.docs[j]) for j in r] for r in pack_epoch(self.lengths, self.max_length, self.seed, epoch)]
            # Epochs pack into slightly different row counts: cycle rows so every batch is full.
            need = self.batches_per_epoch * self.rows_per_batch
            rows = (rows * math.ceil(need / len(rows)))[:need]
            for i in range(k, self.batches_per_epoch):
                if (epoch * self.batches_per_epoch + i - skip) % round_size in mine:
                    yield epoch, make_batch(self.corpus, rows[i * self.rows_per_batch:(i + 1) * self.rows_per_batch],
                                            self.max_length)
            epoch, k = epoch + 1, 0


def split_validation(corpus, fraction, seed):
    """(training documents, validation documents): about a fraction of the documents held out
    and never trained on; none where that would leave either side empty. The documents that open
    with the same prompt (the tokens before the first trained one; the whole text where none
    comes before it) are held out together: data the target wrote greedily answers a repeated
    question (ShareGPT repeats many) with the same text, and a copy left in training would make
    the held-out figures read memorised text. Prompts are held out in the order of a seeded hash
    of their tokens, not by document index, so data regenerated with other answers (another
    document count) keeps the same held-out prompts and its figures compare."""
    n = len(corpus)
    k = int(n * fraction)
    if k < 1 or k >= n:
        return np.arange(n), np.zeros(0, np.int64)
    key = []
    for i in range(n):
        ids, mask = corpus.doc(i)
        first = int(np.argmax(mask > 0)) if mask.any() else len(ids)
        key.append(hashlib.sha1((ids[:first] if first else ids).tobytes()).digest())  # no prompt: the whole text
    docs_of = collections.Counter(key)
    salt = f"{seed}:validation".encode()
    chosen, count = set(), 0
    for prompt in sorted(docs_of, key=lambda p: hashlib.sha1(salt + p).digest()):
        if count >= k:
            break
        chosen.add(prompt)
        count += docs_of[prompt]
    held = np.array([i for i in range(n) if key[i] in chosen], dtype=np.int64)
    if len(held) >= n:
        return np.arange(n), np.zeros(0, np.int64)
    return np.setdiff1d(np.arange(n), held), held


def validation_batches(corpus, max_length, seed, max_rows, rows_per_batch):
    """Up to max_rows rows [max_length] of the validation documents, packed, in batches of the
    training step's rows (a validation makes a few calls, not one a row), each with the anchor
    noise its rows keep over the run (the same anchors every time: the figures compare)."""
    rows = pack_epoch(corpus.lengths, max_length, seed, 0)[:max_rows]
    batches = []
    for first in range(0, len(rows), rows_per_batch):
        batch = make_batch(corpus, rows[first:first + rows_per_batch], max_length)
        batch["anchor_noise"] = torch.cat([torch.rand(1, max_length, generator=torch.Generator().manual_seed(first + k))
                                           for k in range(len(batch["input_ids"]))])
        batches.append(batch)
    return batches


def validation_row_count(validation):
    return sum(len(batch["input_ids"]) for batch in validation)


def prepare_data(settings, files, tokenizer, vocab_size, log):
    """The data stage end to end: tokenised corpus (cached), the fixed-shape batch sequence of its
    training documents, and rows of its held-out validation documents (--val-fraction)."""
    corpus = load_corpus(files, tokenizer, settings.max_length, vocab_size, settings.cache_dir,
                         settings.chat_template_kwargs, log, workers=settings.data_workers,
                         fields=settings.data_fields)
    train_docs, val_docs = split_validation(corpus, settings.val_fraction, settings.seed)
    validation = validation_batches(corpus.subset(val_docs), settings.max_length, settings.seed, settings.val_rows,
                                    settings.rows_per_batch) if len(val_docs) else []
    if validation:
        log(f"data: {len(val_docs)} documents held out for validation ({validation_row_count(validation)} rows), "
            "never trained on")
    batches = BatchSequence(corpus, settings.rows_per_batch, settings.max_length, settings.seed, train_docs)
    return corpus, batches, validation


# -----------------------------------------------------------------------------
# Target stage: frozen replicas, only as deep as the deepest layer the drafter reads, no LM head

def document_visible(q_idx, kv_idx, q_doc, kv_doc, sliding_window=None):
    """The target stage's attention rule: a query sees keys at or before it in its own document
    (packed documents are independent); with sliding_window, only keys fewer than that many
    positions back (transformers' sliding-attention layers). One rule, three forms below."""
    seen = (kv_idx <= q_idx) & (q_doc == kv_doc)
    return seen & (q_idx - kv_idx < sliding_window) if sliding_window is not None else seen


def document_causal_mask(doc_ids, dtype, sliding_window=None):
    """document_visible as an additive [R, 1, L, L] mask. A finite minimum keeps padding rows
    free of NaN."""
    pos = torch.arange(doc_ids.shape[1], device=doc_ids.device)
    allowed = document_visible(pos[:, None], pos[None, :], doc_ids[:, :, None], doc_ids[:, None, :], sliding_window)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=doc_ids.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def document_block_mask(doc_ids, sliding_window=None, tile=128):
    """document_visible as flex_attention's BlockMask: tiles of tile x tile (query, key) pairs
    are classified once per batch as fully visible (computed without the rule), partly (the rule
    evaluated inside the kernel) or not at all (skipped), from each tile's first and last
    document and position, so neither the classification nor any layer touches an [L, L] mask.
    A row's documents are contiguous with ascending ids (padding, -1, after them all)."""
    R, L = doc_ids.shape
    n = -(-L // tile)
    docs = torch.where(doc_ids < 0, torch.iinfo(doc_ids.dtype).max, doc_ids)  # padding last: ascending rows
    start = torch.arange(n, device=docs.device) * tile  # each tile's first and last position
    end = (start + tile - 1).clamp(max=L - 1)
    first, last = docs[:, start], docs[:, end]  # [R, n]: each tile's first and last document
    q_first, q_last, k_first, k_last = first[:, :, None], last[:, :, None], first[:, None, :], last[:, None, :]
    # some query sees some key: a document in both tiles (rows ascend), and a key not after a query
    some = (k_first <= q_last) & (q_first <= k_last) & (start[None, None, :] <= end[None, :, None])
    # every query sees every key: one document in both, every key before every query, whole tiles
    full = (q_first == q_last) & (k_first == q_first) & (k_last == q_first) & \
        (end[None, None, :] <= start[None, :, None]) & ((start + tile <= L)[None, :, None])
    if sliding_window is not None:
        some = some & (start[None, :, None] - end[None, None, :] < sliding_window)
        full = full & (end[None, :, None] - start[None, None, :] < sliding_window)

    def mask_mod(b, h, q_idx, kv_idx):
        return document_visible(q_idx, kv_idx, doc_ids[b, q_idx.clamp(max=L - 1)],
                                doc_ids[b, kv_idx.clamp(max=L - 1)], sliding_window)

    return dm.block_mask_of_tiles((some & ~full)[:, None], full[:, None], mask_mod, (L, L), tile)


TARGET_INPUTS = ("input_ids", "position_ids", "doc_ids")  # what the target stage reads of a batch


class GateUpMLP(torch.nn.Module):
    """A gated MLP, down(act(gate(x)) * up(x)), its gate and up weights stacked in one matrix. In
    a compiled layer they are one matmul, twice as wide, which runs nearer the peak than the two,
    inductor splitting its output inside the activation's pass; in eager mode two matmuls on the
    matrix's halves, as the MLP ran, since eager elementwise work on the split halves is slower
    (docs/architecture.md). Built from the target's own MLP, whose weights it
    takes over."""

    def __init__(self, mlp):
        super().__init__()
        gate, up = mlp.gate_proj, mlp.up_proj
        self.weight = torch.nn.Parameter(torch.cat([gate.weight, up.weight]), requires_grad=False)
        self.bias = (None if gate.bias is None
                     else torch.nn.Parameter(torch.cat([gate.bias, up.bias]), requires_grad=False))
        self.down_proj, self.act_fn = mlp.down_proj, mlp.act_fn

    def forward(self, x):
        if torch.compiler.is_compiling():
            gate, up = torch.nn.functional.linear(x, self.weight, self.bias).chunk(2, dim=-1)
        else:
            biases = (None, None) if self.bias is None else self.bias.chunk(2)
            gate, up = (torch.nn.functional.linear(x, w, b) for w, b in zip(self.weight.chunk(2), biases))
        return self.down_proj(self.act_fn(gate) * up)


def stack_gate_up(model):
    """Each decoder layer's gated MLP (gate_proj, up_proj, down_proj, act_fn, the forward of
    Llama, Qwen and Gemma) replaced by a GateUpMLP; it is checked to give the MLP's output on a few
    random tokens first, and an MLP of any other form is left as it is. Returns how many it stacked."""
    stacked = 0
    for layer in decoder_layers(model):
        mlp = getattr(layer, "mlp", None)
        if mlp is None or {n for n, _ in mlp.named_children()} != {"gate_proj", "up_proj", "down_proj", "act_fn"}:
            continue
        gate, up = mlp.gate_proj, mlp.up_proj
        if not (type(gate) is type(up) is torch.nn.Linear and gate.weight.shape == up.weight.shape
                and (gate.bias is None) == (up.bias is None)):
            continue
        candidate = GateUpMLP(mlp)
        w = gate.weight
        x = torch.randn(4, w.shape[1], device=w.device, generator=torch.Generator(w.device).manual_seed(0)).to(w.dtype)
        with torch.no_grad():
            want, got = mlp(x).float(), candidate(x).float()
        if not torch.allclose(got, want, rtol=0.02, atol=0.02 * want.abs().max().item()):
            continue
        layer.mlp = candidate
        stacked += 1
    return stacked


def next_token_top_k(last_hidden, lm_head, top_k, temperature, softcap=None, chunk_size=4096):
    """The target's next-token distribution at a temperature after each position, as its top_k
    most likely tokens: (ids int32, probabilities fp32) [R, L, top_k]. The LM head runs chunk_size
    positions at a time (one chunk of logits in memory); softcap: the model's final logit
    soft-capping (Gemma), applied as its forward does."""
    flat = last_hidden.flatten(0, 1)
    ids, probs = [], []
    for start in range(0, flat.shape[0], chunk_size):
        logits = lm_head(flat[start:start + chunk_size]).float()
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        top = token_probs(logits, temperature).topk(top_k, dim=-1)
        probs.append(top.values)
        ids.append(top.indices.int())
    shape = (*last_hidden.shape[:2], top_k)
    return torch.cat(ids).view(shape), torch.cat(probs).view(shape)


DISTRIBUTION_KEYS = ("target_top_ids", "target_top_probs")  # what the target stage adds for --loss kl/mix


def stage_bounds(num_layers, stages):
    """[0, b1, ..., num_layers]: the first decoder layer of each of `stages` contiguous ranges, as
    equal in layer count as they go."""
    if not 1 <= stages <= num_layers:
        raise UsageError(f"--target-stages {stages}: a replica of {num_layers} decoder layers splits into 1 to "
                         f"{num_layers} stages")
    return [round(i * num_layers / stages) for i in range(stages + 1)]


def on_device(x, device, copy=False):
    """x (a tensor, a tuple of tensors, or a dict of either) on device; copy: always a new tensor."""
    if isinstance(x, dict):
        return {k: on_device(v, device, copy) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(on_device(v, device, copy) for v in x)
    return x.to(device, non_blocking=True, copy=copy)


def copy_into(static, values):
    """Each tensor of the dict `values` copied into static's tensor of the same key (a tuple into
    a tuple), across devices if need be: a CUDA copy between devices is ordered after the work
    already queued on both devices' current streams, and theirs after it."""
    for key, buf in static.items():
        for dst, src in zip(buf, values[key]) if isinstance(buf, tuple) else [(buf, values[key])]:
            dst.copy_(src, non_blocking=True)


@contextlib.contextmanager
def timed(clocks, k, device):
    """The work queued inside timed by clocks[k] (a StageClock) on device; untimed without clocks."""
    if clocks is None:
        yield
        return
    clocks[k].start(device)
    yield
    clocks[k].stop(device)


class TargetStage:
    """Decoder layers [first, end) of a target replica, on one device, run by the base model's own
    forward (its masks, rotary embeddings, per-layer arguments), so every architecture the stage
    runs whole runs split. The first stage reads the token ids; a later one the hidden states the
    stage before it passes on: given as inputs_embeds, and put in front of its first layer by a
    pre-hook too, since some base models scale inputs_embeds (Granite) where they scale the
    embedding's output. A stage passes on its last layer's output, before the final norm."""

    def __init__(self, model, first, end, device):
        base = getattr(model, model.base_model_prefix)
        self.first, self.end, self.device = first, end, device
        if first == 0 and end == len(base.layers):
            self.base = base
            return
        self.base = copy.copy(base)  # shares base's parameters; a children dict of its own:
        self.base._modules = dict(base._modules)
        self.base.config = slice_layers(copy.copy(base.config), first, end)
        self.base.layers = torch.nn.ModuleList(base.layers[first:end])
        for name, child in base.named_children():
            # the small parts the forward runs on every stage (the final norm, rotary embeddings)
            # where this stage's layers are; the embedding is the first stage's alone
            if name != "layers" and child is not model.get_input_embeddings() and \
                    any(t.device != device for t in itertools.chain(child.parameters(), child.buffers())):
                self.base._modules[name] = copy.deepcopy(child).to(device)

    def forward(self, input_ids, hidden, position_ids, attention_mask, captured):
        """(the outputs of this stage's layers `captured` (its own indices), its last layer's
        output, the base model's output). hidden: the stage before's output; None on the first."""
        first_layer = self.base.layers[0]

        def enter(module, args, kwargs):
            if args:
                return (hidden, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": hidden}

        hook = None if hidden is None else first_layer.register_forward_pre_hook(enter, with_kwargs=True)
        try:
            with collect_layer_outputs(self.base, [*captured, len(self.base.layers) - 1]) as outs:
                out = self.base(input_ids=input_ids if hidden is None else None, inputs_embeds=hidden,
                                attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        finally:
            if hook is not None:
                hook.remove()
        return outs[:-1], outs[-1], out.last_hidden_state


class TargetReplica:
    """A frozen target, whole on one device or split over several as contiguous layer ranges (one
    TargetStage per device of `devices`; a device may hold several stages). With --compile each
    stage's fixed-shape forward is captured once as its own CUDA graph, so the main thread issues
    a few calls per stage and batch; a stage's outputs go to the next stage's device by copies
    that the devices' streams order, so with several batches in flight every stage's GPU works.
    Its outputs, on the last stage's device: the features the drafter reads (target_hidden), and
    with a distillation (--loss kl/mix) the target's next-token distribution as its top k
    (DISTRIBUTION_KEYS), from the LM head inside the last stage's forward and graph."""

    def __init__(self, model, target_layer_ids, devices, target_attention="dense", compile_layers=False,
                 distillation=None, stack_mlps=True):
        self.devices = [torch.device(d) for d in (devices if isinstance(devices, (list, tuple)) else [devices])]
        self.model, self.target_layer_ids, self.device = model, target_layer_ids, self.devices[-1]
        self.distillation = distillation
        self.dtype = next(model.parameters()).dtype
        tc = dm.text_config(model.config)
        self.final_softcap = getattr(tc, "final_logit_softcapping", None)  # Gemma's, on the LM head's logits
        # Sliding windows: targets with sliding-window layers among full ones (Gemma 3, Qwen2's
        # use_sliding_window) take one mask per layer type; a plain `sliding_window` with no layer
        # types (Mistral, Phi-3) windows every layer. A mask passed in replaces the model's own, so
        # the window must be in it, or the features silently differ from the model's.
        self.window_layers, self.sliding_window = target_windows(tc)
        # The flex BlockMask in the tiles of the kernel that reads it: a partly visible tile is
        # computed whole, so smaller tiles compute fewer masked pairs (10% fewer at Qwen3-8B's batch)
        options = target_flex_kernel_options(self.devices[0], dm.attention_shape(tc)[2])
        self.mask_tile = dm.flex_mask_tile(options)
        bounds = stage_bounds(len(decoder_layers(model)), len(self.devices))
        self.stages = [TargetStage(model, a, b, d) for a, b, d in zip(bounds, bounds[1:], self.devices)]
        # each stage's captured layers (its own indices) in the order they pass along, and where
        # each of target_layer_ids is in that order
        self.captured = [[i - s.first for i in target_layer_ids if s.first <= i < s.end] for s in self.stages]
        passed = [i for s in self.stages for i in target_layer_ids if s.first <= i < s.end]
        self.order = [passed.index(i) for i in target_layer_ids]
        self.own_attention = model.config._attn_implementation
        self.set_attention(target_attention)
        self.stacked_mlps = stack_gate_up(model) if stack_mlps else 0
        if compile_layers:
            self.set_compiled_layers(True)
        self.graphs = None  # per stage: (CUDA graph, static inputs, static outputs)

    def set_attention(self, target_attention):
        """dense: the model's own attention (SDPA) under an additive [R, 1, L, L] mask; flex:
        flex_attention under a document BlockMask (empty tiles skipped, full ones computed
        without a mask). A captured forward keeps the attention it was captured with."""
        self.target_attention = target_attention
        self.use_attention = attention_implementation(
            [self.model] + [s.base for s in self.stages],
            register_flex_attention(target_stage=True) if target_attention == "flex" else self.own_attention)

    def set_compiled_layers(self, on):
        """Each decoder layer compiled by inductor (its elementwise work fused; one graph serves
        every layer), or back to the plain layers."""
        for layer in decoder_layers(self.model):
            if on:
                layer.compile(dynamic=False)
            else:
                layer._compiled_call_impl = None  # what nn.Module.compile set

    def mask(self, doc_ids, sliding_window=None):
        if self.target_attention == "flex":
            return document_block_mask(doc_ids, sliding_window, self.mask_tile)
        return document_causal_mask(doc_ids, self.dtype, sliding_window)

    def masks(self, doc_ids):
        """The attention mask the layers read: per layer type where some layers slide."""
        if self.window_layers == "every":
            return self.mask(doc_ids, self.sliding_window)
        if self.window_layers == "some":
            return {"full_attention": self.mask(doc_ids), "sliding_attention": self.mask(doc_ids, self.sliding_window)}
        return self.mask(doc_ids)

    def run_stage(self, k, inputs, packed=True):
        """Stage k on inputs on its device: the batch's TARGET_INPUTS and, after the first stage,
        what the stage before passed on (`hidden`, `captured`). Returns what it passes on, or from
        the last stage the replica's outputs: {target_hidden: the outputs of the target layers the
        drafter reads, concatenated, [R, L, n*H]; none without layers} and, with a distillation,
        the top-k distribution after each position (next_token_top_k). packed=False: one
        unpacked sequence under the model's own attention and masks (no mask passed in)."""
        stage = self.stages[k]
        mask = self.masks(inputs["doc_ids"]) if packed else None
        mine, last_layer, final = stage.forward(inputs.get("input_ids"), inputs.get("hidden"),
                                                inputs.get("position_ids"), mask, self.captured[k])
        captured = (*inputs.get("captured", ()), *mine)
        if k < len(self.stages) - 1:
            return {"hidden": last_layer, "captured": captured}
        out = {"target_hidden": torch.cat([captured[i] for i in self.order], dim=-1)} if captured else {}
        if self.distillation is not None and packed:
            d = self.distillation
            out.update(zip(DISTRIBUTION_KEYS, next_token_top_k(
                final, self.model.get_output_embeddings(), d["top_k"], d["temperature"], self.final_softcap)))
        return out

    def forward(self, input_ids, position_ids, doc_ids, packed=True, clocks=None):
        """The replica's outputs (run_stage's) for the batch's inputs, on any device, eagerly.
        clocks: a StageClock per stage, timing each stage's work on its device."""
        passed = {}
        with self.use_attention if packed else contextlib.nullcontext():
            for k, stage in enumerate(self.stages):
                inputs = {"position_ids": position_ids, "doc_ids": doc_ids, **passed}
                if k == 0:
                    inputs["input_ids"] = input_ids
                inputs = on_device({key: v for key, v in inputs.items() if v is not None}, stage.device)
                with timed(clocks, k, stage.device):
                    passed = self.run_stage(k, inputs, packed)
        return passed

    @torch.no_grad()
    def outputs(self, batch, clocks=None):
        """forward's outputs for a batch (a dict holding at least the forward's three inputs)."""
        if self.graphs is None:
            return self.forward(**{k: batch[k] for k in TARGET_INPUTS}, clocks=clocks)
        passed = {}
        for k, (graph, static_in, static_out) in enumerate(self.graphs):
            copy_into(static_in, {**batch, **passed})  # waits for the stage before: not timed
            with timed(clocks, k, self.stages[k].device):
                graph.replay()
            passed = static_out
        return passed  # overwritten by the next replay: the caller copies it

    def target_hidden(self, batch):
        """The features alone of a batch."""
        return self.outputs(batch)["target_hidden"]

    def synthetic_batch(self, rows, length):
        dev = self.devices[0]
        return {"input_ids": torch.randint(0, dm.text_config(self.model.config).vocab_size, (rows, length), device=dev),
                "position_ids": torch.arange(length, device=dev).repeat(rows, 1),
                "doc_ids": torch.zeros(rows, length, dtype=torch.long, device=dev)}

    @torch.no_grad()
    def capture(self, rows, length):
        """Each stage's forward captured as a CUDA graph on its device, on static inputs of its own."""
        batch, passed, self.graphs = self.synthetic_batch(rows, length), {}, []
        for k, stage in enumerate(self.stages):
            static_in = on_device({**{key: batch[key] for key in TARGET_INPUTS if k == 0 or key != "input_ids"},
                                   **passed}, stage.device, copy=True)
            side = torch.cuda.Stream(stage.device)
            side.wait_stream(torch.cuda.current_stream(stage.device))
            with torch.cuda.stream(side), self.use_attention:
                for _ in range(2):
                    self.run_stage(k, static_in)
            torch.cuda.current_stream(stage.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"), self.use_attention:
                static_out = self.run_stage(k, static_in)
            torch.cuda.synchronize(stage.device)
            self.graphs.append((graph, static_in, static_out))
            passed = static_out

    def drop_capture(self):
        """Back to eager forwards; the graphs' pools and static buffers are let go."""
        self.graphs = None


@torch.no_grad()
def stage_against_transformers(replica, batch):
    """The target stage's features of a packed row (the first of a batch: several documents, as
    training sees them) against the model's own forward of each document alone (transformers'
    attention and masks, no packing mask; the same stages where the replica is split): per layer
    the drafter reads, the largest relative error ||stage - forward|| / ||forward|| over the
    documents. A stage whose masks or kernels compute something else than the model (a window
    missed, a mask tile wrong) shows here by layer."""
    outputs = replica.outputs({k: batch[k][:1] for k in TARGET_INPUTS})["target_hidden"][0].float()
    doc_ids = batch["doc_ids"][0]
    n = len(replica.target_layer_ids)
    errors = [0.0] * n
    for doc in doc_ids.unique().tolist():
        if doc < 0:  # padding
            continue
        at = (doc_ids == doc).nonzero()[:, 0]
        alone = replica.forward(batch["input_ids"][0, at][None], None, None, packed=False)["target_hidden"][0].float()
        width = outputs.shape[-1] // n
        for i in range(n):
            got = outputs[at.to(outputs.device), i * width:(i + 1) * width]
            want = alone[:, i * width:(i + 1) * width].to(got.device)
            errors[i] = max(errors[i], ((got - want).norm() / want.norm().clamp(min=1e-12)).item())
    return dict(zip(replica.target_layer_ids, errors))


def fits_in_memory(step):
    """Runs step(); False if the GPU ran out of memory. The error is dropped on the way out, and
    with it the failed step's frames and the tensors they hold."""
    try:
        step()
        return True
    except torch.cuda.OutOfMemoryError:
        return False


def rows_that_should_fit(device, one_row_step, drop_capture):
    """The rows whose step should fit, from the peak memory of one row (one_row_step: the step as
    the run runs it, compiled with --compile, without a graph), with 10% to spare. drop_capture()
    frees what a warm-up left first. Returns (rows, bytes per row)."""
    drop_capture()
    # The measured run is the second: the first also compiles, autotunes and makes first-use
    # allocations, and what it measured varied (on an H200 the target's estimate from a first run
    # was 2.6x smaller than from a second).
    one_row_step()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    one_row_step()
    per_row = max(torch.cuda.max_memory_allocated(device) - base, 1)
    torch.cuda.empty_cache()  # memory the allocator keeps cached is free for the rows too
    free, _ = torch.cuda.mem_get_info(device)
    return max(int(0.9 * (free + torch.cuda.memory_allocated(device) - base) // per_row), 0), per_row


def budget_error(stage, device, settings, warm, one_row_step, drop_capture):
    """Runs warm(rows) at the --token-budget's rows; None if that fits. If it runs out of memory:
    estimate the rows that should fit (rows_that_should_fit), try them with warm, 15% fewer after
    each failure (a CUDA graph capture, or a batch far larger than one row, can need more than the
    estimate: measured on an H200, docs/benchmarks.md), and return the error message naming the
    largest budget that was tried and fit. drop_capture() after every try: the run stops either way."""
    if fits_in_memory(lambda: warm(settings.token_budget // settings.max_length)):
        return None
    rows, per_row = rows_that_should_fit(device, one_row_step, drop_capture)
    while rows > 0:
        fits = fits_in_memory(lambda: warm(rows))
        drop_capture()
        torch.cuda.empty_cache()
        if fits:
            break
        rows = int(rows * 0.85)
    said = f"--token-budget {settings.token_budget} does not fit the {stage} on {device} ({per_row / 2**30:.1f} GB " \
        f"per row of {settings.max_length})"
    if rows == 0:  # not even one row: a row holds less, or is shorter
        fewer = "fewer anchors a row (--num-anchors " + str(settings.num_anchors) + ")" if stage == "drafter step" \
            else "more stages a replica (--target-stages), fewer target layers read (--target-layer-ids)"
        return f"{said}; not even one row fits: {fewer} or a shorter --max-length"
    return f"{said}; the largest that fits is about --token-budget {rows * settings.max_length}"


def warm_up_target(replicas, settings, log):
    """One fixed-shape forward per replica (captured as a CUDA graph with --compile), so a token
    budget that does not fit shows now, with the largest that does."""
    def warm(r, rows):
        if settings.compile:
            with COMPILE_LOCK:
                r.capture(rows, settings.max_length)
        else:
            r.outputs(r.synthetic_batch(rows, settings.max_length))

    for r in replicas:
        error = budget_error("target stage", r.device, settings, lambda rows: warm(r, rows),
                             lambda: r.outputs(r.synthetic_batch(1, settings.max_length)), r.drop_capture)
        if error:
            raise UsageError(error)
    if settings.compile:
        log(f"target: forward captured as a CUDA graph on {[str(r.device) for r in replicas]}")


def load_target_replicas(name, devices, target_layer_ids, log=print, target_attention="dense", compile_layers=False,
                         distillation=None, stages=1):
    """One frozen replica per `stages` consecutive target devices (one device each: a replica
    whole; several: split into as many contiguous layer ranges, TargetStage), with only the
    decoder layers up to the deepest one the drafter reads (all of them and the LM head with a
    distillation: its distribution is the LM head's). The weights load shard by shard straight
    onto the device that holds them (transformers' device_map), never the whole model in host
    memory. Also returns the target's embedding module and LM head weight (CPU copies) for the
    drafters."""
    from transformers import AutoConfig
    path = resolve_model_path(name)
    dtype = torch.bfloat16 if devices[0].type == "cuda" else torch.float32
    config = AutoConfig.from_pretrained(path)
    n_layers = dm.text_config(config).num_hidden_layers
    keep = layers_run(n_layers, target_layer_ids, distillation is not None)
    tied = getattr(config, "tie_word_embeddings", False)
    slice_layers(dm.text_config(config), 0, keep)
    replicas = []
    for first in range(0, len(devices), stages):
        on = devices[first:first + stages]
        # the LM head: the last stage's for a distillation; otherwise only the drafters' copy
        # (on the host), unless the embedding shares its weight
        head_device = on[-1] if distillation is not None else on[0] if tied else "cpu"
        model = load_layers(path, config, n_layers, on, head_device, dtype)
        if not replicas:
            embed = copy.deepcopy(model.get_input_embeddings()).cpu()
            head = model.get_output_embeddings().weight.detach().to("cpu", copy=True)
        replicas.append(TargetReplica(model, target_layer_ids, on, target_attention, compile_layers, distillation))
    bounds = stage_bounds(keep, stages)
    split = "" if stages == 1 else " split " + ", ".join(f"{a}-{b - 1}" for a, b in zip(bounds, bounds[1:]))
    log(f"target: {type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters "
        f"a replica; running {keep} of {n_layers} layers{split} on {[str(d) for d in devices]} in {dtype}; "
        f"{target_attention} attention" + (", layers compiled" if compile_layers else "")
        + f"; gate and up stacked in {replicas[0].stacked_mlps} MLPs"
        + ("" if distillation is None else "; the LM head's top-{top_k} at temperature {temperature:g} for the "
           "distillation".format(**distillation)))
    return replicas, embed, head


def slice_layers(config, first, end):
    """config (a text config) made one of decoder layers [first, end), in place: every per-layer
    list (layer_types, ...) sliced, so a base model's forward that indexes them by its loop's
    counter reads layer first + i's entry for its i-th layer."""
    n = config.num_hidden_layers
    for key, value in list(vars(config).items()):
        if isinstance(value, (list, tuple)) and len(value) == n:
            setattr(config, key, type(value)(value[first:end]))
    config.num_hidden_layers = end - first
    return config


def load_layers(path, config, n_layers, devices, head_device, dtype):
    """The model of `config` (its layers cut to the replica's) from the checkpoint at path: decoder
    layer i on its stage's device, the embedding and the base model's other parts on the first
    stage's, the LM head on head_device; the checkpoint's layers above them are not read."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    keep, prefix = dm.text_config(config).num_hidden_layers, meta.base_model_prefix
    bounds = stage_bounds(keep, len(devices))
    device_map = {name: str(head_device) for name, _ in meta.named_children() if name != prefix}  # the LM head
    device_map.update({f"{prefix}.{part}": str(devices[0]) for part, _ in getattr(meta, prefix).named_children()
                       if part != "layers"})
    for device, a, b in zip(devices, bounds, bounds[1:]):
        device_map.update({f"{prefix}.layers.{i}": str(device) for i in range(a, b)})
    cls = type(meta)
    above = "|".join(str(i) for i in range(keep, n_layers))
    ignored = cls._keys_to_ignore_on_load_unexpected
    # the layers above the replica's are in the checkpoint, not in the model: not read, not reported
    cls._keys_to_ignore_on_load_unexpected = [*(ignored or ()), *([rf"\blayers\.({above})\."] if above else [])]
    try:
        model = cls.from_pretrained(path, config=config, dtype=dtype, attn_implementation="sdpa",
                                    device_map=device_map)
    finally:
        cls._keys_to_ignore_on_load_unexpected = ignored
    if hasattr(model, "hf_device_map"):  # the stages move tensors between devices themselves
        from accelerate.hooks import remove_hook_from_module
        remove_hook_from_module(model, recurse=True)
    return model.eval().requires_grad_(False)


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
        # On CUDA one kernel over flat buffers, in the graph (capturable); it keeps the bf16 weights
        # the matmuls read. Without triton, torch's fused capturable AdamW; on the CPU its foreach one.
        flat_adamw = cuda and dm.triton is not None
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
            self.optimizer = torch.optim.AdamW(owned, lr=self.lr, weight_decay=settings.weight_decay,
                                               **(dict(fused=True, capturable=True) if cuda else dict(foreach=True)))
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

def decay_batches(schedule):
    # a schedule recorded before --decay-ratio decays over everything after the warm-up
    return schedule.get("decay_batches", schedule["total_batches"] - schedule["warmup_batches"])


def scheduled_lr(batches_done, schedule, peak):
    """Linear warm-up, the peak held, then cosine to zero over the run's last decay_batches, all
    counted in batches (not steps: a run resumed with another worker count keeps its schedule).
    batches_done counts the step's own."""
    total, warmup, decay = schedule["total_batches"], schedule["warmup_batches"], decay_batches(schedule)
    if batches_done <= warmup:
        return peak * batches_done / max(1, warmup)
    progress = (batches_done - (total - decay)) / max(1, decay)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, progress))))


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
DEFINING_SETTINGS = ("target_model", "data_files", "data_fingerprint", "chat_template_kwargs", "token_budget",
                     "max_length", "num_anchors", "block_size", "num_draft_layers", "target_layer_ids", "mask_token_id",
                     "seed", "training_documents", "distillation")


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

    @classmethod
    def resumed(cls, *fields, run_id=None):
        """A plan continuing a checkpoint's run: its run id (checkpoints without one: a new id)."""
        return cls(*fields, **({"run_id": run_id} if run_id else {}))

    @property
    def total_steps(self):
        return self.start_step + max(0, math.ceil((self.schedule["total_batches"] - self.start_cursor)
                                                  / self.num_workers))

    def cursor_after(self, step):
        return self.start_cursor + (step - self.start_step) * self.num_workers


def defining_settings(settings, corpus, training_documents=None):
    """The defining settings of a run, as recorded in its checkpoints; training_documents (the
    corpus indices it trains on, the validation documents left out) recorded as a hash."""
    s = {k: getattr(settings, k) for k in DEFINING_SETTINGS if hasattr(settings, k)}
    s.update(data_files=[os.path.abspath(p) for p in settings.data_files], data_fingerprint=corpus.fingerprint(),
             training_documents=None if training_documents is None else
             hashlib.sha256(np.asarray(training_documents, np.int64).tobytes()).hexdigest()[:16])
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
    state = {"step": step, "consumed_batches": plan.cursor_after(step), "num_workers": plan.num_workers,
             "schedule": plan.schedule, "length_flags": plan.length_flags, "settings": plan.defining,
             "elapsed_s": elapsed_s, "run_id": plan.run_id, "optimizer": optimizer_state}
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


def load_checkpoint(path):
    """(weights, training state) of a checkpoint directory; raises if either cannot be read."""
    from safetensors.torch import load_file
    weights = load_file(os.path.join(path, "model.safetensors"))
    state = torch.load(os.path.join(path, "training_state.pt"), map_location="cpu", weights_only=False)
    return weights, state


def find_checkpoint(spec, out_dir, log):
    """(directory, weights, state) to resume from, or None. 'auto': the newest checkpoint in
    out_dir that can be read, saying which were passed over and why."""
    if spec != "auto":
        if not os.path.exists(os.path.join(spec, "training_state.pt")):
            raise UsageError(f"--resume {spec}: not a checkpoint directory (no training_state.pt)")
        return (spec, *load_checkpoint(spec))
    steps = checkpoint_steps(out_dir)
    for step in reversed(steps):
        path = os.path.join(out_dir, "checkpoints", f"step_{step}")
        try:
            return (path, *load_checkpoint(path))
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
    old = state.get("settings")
    if old is None:
        log("resume: the checkpoint predates recorded settings; they are not checked")
    else:
        if "layer_ids" in old:  # checkpoints that named the target layers so
            old = {("target_layer_ids" if k == "layer_ids" else k): v for k, v in old.items()}
        unrecorded = [k for k in DEFINING_SETTINGS if k in defining and k not in old]
        if unrecorded:  # a checkpoint from before they were recorded
            log(f"resume: the checkpoint does not record {', '.join(unrecorded)}; not checked")
        diff = [f"{k} {old[k]!r} -> {defining.get(k)!r}" for k in DEFINING_SETTINGS
                if k in old and old[k] != defining.get(k)]
        if diff and not settings.resume_anyway:
            raise UsageError("--resume: the checkpoint was made with other settings: " + "; ".join(diff)
                             + " (restore them, or pass --resume-anyway to continue regardless)")
        if diff:
            log("resume: continuing despite other settings (--resume-anyway): " + "; ".join(diff))
    cursor = state.get("consumed_batches", state["step"] * num_workers)
    recorded = state.get("schedule")
    recorded_flags = {"decay_ratio": 1.0, **(state.get("length_flags") or {})}  # older checkpoints: the one schedule
    if recorded is not None and recorded_flags == flags:
        schedule = recorded
    elif recorded is not None:
        log(f"resume: schedule changed with {flags} (was {recorded_flags}): "
            f"{recorded['total_batches']} -> {schedule['total_batches']} batches in all, warm-up "
            f"{recorded['warmup_batches']} -> {schedule['warmup_batches']}")
    if state.get("num_workers", num_workers) != num_workers:
        log(f"resume: {num_workers} drafter workers now, {state['num_workers']} when the checkpoint was made: "
            f"continuing from batch {cursor} with the same schedule")
    return RunPlan.resumed(state["step"], cursor, num_workers, schedule, defining, flags, state.get("elapsed_s", 0.0),
                           run_id=state.get("run_id"))


def length_flags(settings):
    return {"max_steps": settings.max_steps, "epochs": settings.epochs, "warmup_ratio": settings.warmup_ratio,
            "decay_ratio": settings.decay_ratio}


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
        """One line of metrics.jsonl (first machine only), stamped with the training time so far."""
        if self.metrics is not None:
            self.metrics.write(json.dumps({"step": rec["step"], "elapsed_s": round(self.elapsed_s(), 1), **rec}) + "\n")
            self.metrics.flush()


class StageClock:
    """Busy time and batch count of a stage whose work is asynchronous on a GPU: CUDA event pairs,
    read once they have completed (no host sync); wall time on CPU. The main thread starts and
    stops it, a worker thread reads it: a lock keeps the two apart."""

    def __init__(self):
        self.pending, self.seconds, self.batches, self.t0 = [], 0.0, 0, None
        self.lock = threading.Lock()

    def start(self, device):
        if device.type == "cuda":
            self.t0 = torch.cuda.Event(enable_timing=True)
            self.t0.record(torch.cuda.current_stream(device))
        else:
            self.t0 = time.perf_counter()

    def stop(self, device):
        if device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(device))
            with self.lock:
                self.pending.append((self.t0, end))
        else:
            with self.lock:
                self.seconds += time.perf_counter() - self.t0
                self.batches += 1

    def total(self):
        """(busy seconds, batches) of the work that has completed so far."""
        with self.lock:
            done = [p[1].query() for p in self.pending]
            self.seconds += sum(a.elapsed_time(b) for (a, b), d in zip(self.pending, done) if d) / 1000
            self.batches += sum(done)
            self.pending = [p for p, d in zip(self.pending, done) if not d]
            return self.seconds, self.batches


def split_advice(target_s, drafter_s, target_devices, drafter_devices, tokens_per_batch):
    """Which stage bounds the run and the fastest split of the same GPUs, from the busy seconds
    of one target forward per replica (target_s) and of one drafter step per worker (drafter_s),
    each a batch of tokens_per_batch. The stages run at n_target / target_s and n_drafter /
    drafter_s batches a second, the run at the smaller (gradient averaging across more drafter
    workers is not modelled). The times are taken in the run, so on a device both stages share
    each already includes the other's company, and the two overlap: the slower one bounds the
    run (measured on one H200 with a 0.13B target: 91 and 87 ms advised 180K tokens/s, the run
    made 173K), and alone on a GPU each would be faster than its time here. Returns a dict with
    the figures and the log line."""
    nt, nd = len(target_devices), len(drafter_devices)
    target_rate, drafter_rate = nt * tokens_per_batch / target_s, nd * tokens_per_batch / drafter_s
    if set(target_devices) & set(drafter_devices):
        expected = tokens_per_batch / max(target_s, drafter_s)
        return {"bound": "shared", "expected_tokens_per_s": expected, "best": None,
                "line": f"split: target and drafter share {sorted({str(d) for d in target_devices + drafter_devices})} "
                        f"(target {target_s * 1e3:.0f} ms/batch, drafter {drafter_s * 1e3:.0f} ms/step, each beside "
                        f"the other): about {expected:,.0f} tokens/s; on two GPUs, 1+1 would run at "
                        f"{min(target_rate / nt, drafter_rate / nd):,.0f} or more"}
    gpus = sorted(target_devices + drafter_devices, key=lambda d: (d.type, d.index or 0))
    rate = lambda n: min(n * tokens_per_batch / target_s, (len(gpus) - n) * tokens_per_batch / drafter_s)
    best = max(range(1, len(gpus)), key=rate)
    bound = "drafter" if drafter_rate < target_rate else "target"
    flags = (f"--target-gpus {','.join(str(d.index) for d in gpus[:best])} "
             f"--drafter-gpus {','.join(str(d.index) for d in gpus[best:])}")
    line = (f"split: {bound}-bound: target {nt} x {target_s * 1e3:.0f} ms/batch = {target_rate:,.0f} tokens/s, "
            f"drafter {nd} x {drafter_s * 1e3:.0f} ms/step = {drafter_rate:,.0f}; "
            f"expected {min(target_rate, drafter_rate):,.0f} tokens/s. "
            + ("This split is the fastest of these GPUs." if best == nt else
               f"Fastest split of these {len(gpus)} GPUs: {best}+{len(gpus) - best} at about "
               f"{rate(best):,.0f} tokens/s ({flags})"))
    return {"bound": bound, "expected_tokens_per_s": min(target_rate, drafter_rate), "target_tokens_per_s": target_rate,
            "drafter_tokens_per_s": drafter_rate, "best": (best, len(gpus) - best, rate(best)),
            "flags": flags if best != nt else None, "line": line}


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
        starts each block where the last one failed, so it lands on the hard positions more often
        (on MT-Bench: tau_hat 4.04, replayed and measured 2.58-2.59; docs/recipe.md)."""
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
            path = resolve_model_path(self.settings.target_model)
            need = sum(os.path.getsize(f) for f in glob.glob(os.path.join(path, "*.safetensors"))) \
                if os.path.isdir(path) else 0
            free = {d: torch.cuda.mem_get_info(d)[0] for d in self.cuda_devices}
            dev = max(free, key=free.get) if free else torch.device("cpu")
            if free and free[dev] < 1.25 * need + 2 * 2**30:
                self.log(f"eval: the target ({need / 2**30:.1f} GB) does not fit beside the run on any GPU "
                         f"(most free: {free[dev] / 2**30:.1f} GB on {dev}); evaluating on the CPU")
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
        main, last = self.cluster.is_main, step == self.total_steps
        # the last step's acceptance is the final evaluation's (not measured twice)
        eval_step = bool(s.eval_interval) and step % s.eval_interval == 0 and not (last and s.eval_prompts > 0)
        val_step = eval_step or last or (bool(s.val_interval) and step % s.val_interval == 0)
        # Every machine logs on the same steps (the figures are summed across machines); only the
        # first evaluates and saves.
        due_log = step % s.log_interval == 0 or last or eval_step or val_step
        due_eval = eval_step and bool(self.held_out.prompts) and main
        due_val = val_step and bool(self.held_out.validation) and main
        due_save = (step % s.save_interval == 0 or last) and main
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
        if main and not os.path.isdir(s.output_dir):
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


@contextlib.contextmanager
def signals_handled(handler):
    """Inside, SIGINT and SIGTERM call handler(signum) instead of ending the process (in the main
    thread; elsewhere signals cannot be caught and nothing changes); the old handlers after."""
    in_main = threading.current_thread() is threading.main_thread()
    old = {s: signal.signal(s, lambda signum, frame: handler(signum)) for s in (signal.SIGINT, signal.SIGTERM)} \
        if in_main else {}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def build_drafters(settings, target_config, embed, head, log):
    """One drafter replica per drafter device, identical at the start, each with the target's
    frozen embedding and LM head on its device."""
    cfg = dm.make_drafter_config(target_config, mask_token_id=settings.mask_token_id,
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
        f"{cfg.block_size}, target layers {master.target_layer_ids}, mask token {settings.mask_token_id}; "
        f"{settings.drafter_attention} attention")
    return drafters


# -----------------------------------------------------------------------------
# One run, stage by stage: the command line and the smoke test call the same stages

class Trainer:
    """A run in four stages: load_data (the corpus, batches, validation rows, the mask token,
    and where a resumed run starts), load_models (the target stage and the drafter replicas),
    train (warm-up, capture, the steps), finish (the final drafter, its evaluation, the plots)."""

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
        self.target_config = dm.text_config(target_config(settings.target_model))
        self.tokenizer = self.corpus = self.batches = self.validation = None  # load_data
        self.plan, self.resumed = None, None  # load_data: the RunPlan; (path, weights, state) resumed from
        self.replicas = self.drafters = None  # load_models
        self.run = None  # train

    def load_data(self):
        """The data stage, then the run's plan. Returns whether there are steps left to train;
        a resume of another run's checkpoint is refused here, before any model loads."""
        s, log, vocab_size = self.settings, self.log, self.target_config.vocab_size
        data = [regenerated_builtin_data(s, log) if p == BUILTIN_REGENERATED else p for p in s.data]
        self.tokenizer = load_tokenizer(s.target_model)
        files = resolve_data_paths(data)
        self.corpus, self.batches, self.validation = prepare_data(s, files, self.tokenizer, vocab_size, log)
        mask_token_id = choose_mask_token_id(self.tokenizer, vocab_size, self.corpus, s.mask_token_id, s.target_model,
                                             s.chat_template_kwargs)
        self.settings = s = s.replace(data_files=files, mask_token_id=mask_token_id)
        if s.init_drafter:
            check_init_drafter(s, self.target_config)
        W = len(s.drafter_devices) * self.cluster.world_size
        self.resumed = find_checkpoint(s.resume, s.output_dir, log) if s.resume else None
        if s.resume and self.resumed is None:
            log("resume: no checkpoint in --output-dir yet; starting fresh")
        state = self.resumed[2] if self.resumed else None
        defining = defining_settings(s, self.corpus, self.batches.docs)
        self.plan = plan = plan_run(s, defining, self.batches, W, state, log)
        if self.resumed:
            log(f"resume: {self.resumed[0]} at step {plan.start_step}, batch {plan.start_cursor}")
            log.drop_records_after(plan.start_step)
        self.cluster.check_same("[step to resume from, total steps, batches per epoch, batch cursor]",
                                [plan.start_step, plan.total_steps, self.batches.batches_per_epoch, plan.start_cursor])
        if self.cluster.world_size > 1:
            log(f"machines: this is {self.cluster.rank} of {self.cluster.world_size} (pid {os.getpid()}); "
                f"{W} drafter workers in all")
        log(f"layout: target {[str(d) for d in s.target_devices]} | "
            f"drafter workers {[str(d) for d in s.drafter_devices]}")
        log(f"batches: {s.rows_per_batch} x {s.max_length} = {s.token_budget} tokens, "
            f"{s.num_anchors * s.rows_per_batch} anchors x block {s.block_size}; packing efficiency "
            f"{self.batches.packing_efficiency:.1%}; {self.batches.batches_per_epoch} batches/epoch; "
            f"{plan.total_steps} steps ({plan.schedule['warmup_batches'] // W} warmup, lr decay over the last "
            f"{decay_batches(plan.schedule) // W})")
        if plan.start_step >= plan.total_steps:
            log(f"nothing to do: already at step {plan.start_step} of {plan.total_steps}")
            return False
        return True

    def load_models(self):
        """The target stage's replicas and the drafter replicas (a resumed run's weights loaded)."""
        s = self.settings
        self.replicas, embed, head = load_target_replicas(s.target_model, s.target_devices, s.target_layer_ids,
                                                          self.log, s.target_attention, s.compile_target,
                                                          s.distillation, s.target_stages)
        self.drafters = build_drafters(s, self.target_config, embed, head, self.log)
        weights = self.resumed[1] if self.resumed is not None else None
        if s.init_drafter:
            from safetensors.torch import load_file
            weights = load_file(os.path.join(s.init_drafter, "model.safetensors"))
            self.log(f"drafter: starting from {s.init_drafter}")
        if weights is not None:
            for d in self.drafters:
                d.load_state_dict(weights)

    def train(self, show_progress=True):
        """Warm-up, capture and every step of the plan (or until a signal or an error)."""
        s, main = self.settings, self.cluster.is_main
        prompts = heldout_prompts(s, self.tokenizer, s.eval_prompts) if s.eval_interval and main else []
        if s.eval_interval and main and not prompts:
            self.log("eval: --eval-interval needs held-out prompts (--eval-data); none, so no evaluation")
        held_out = HeldOut(s, self.validation if main else [], self.tokenizer, prompts, cuda_devices(s), self.log)
        self.run = Run(s, self.plan, self.batches, self.drafters, self.log, held_out, self.cluster)
        return run_pipeline(self.run, self.replicas, self.resumed[2]["optimizer"] if self.resumed else None,
                            show_progress)

    def finish(self):
        """After train: the errors reported, or the last checkpoint and the final drafter saved,
        evaluated on held-out prompts (checked lossless) and plotted. Returns the exit code. A
        signal meanwhile skips the evaluation (if it has not begun) but not the saving."""
        def on_signal(signum):
            self.run.interrupted = True
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
        final_dir = os.path.join(s.output_dir, "final")
        shutil.rmtree(final_dir, ignore_errors=True)
        run.workers[0].drafter.save_pretrained(final_dir, dtype=torch.bfloat16)
        dm.write_training_record(final_dir, self.plan.defining)
        for line in self.corpus.stats.summary():
            log(f"data: {line.strip()}")
        log(f"done: {final_step} steps; drafter saved to {final_dir}")
        self.replicas = None  # the target stage's GPU memory goes to the evaluation's whole target
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        report = self.evaluate_final(final_dir) if not run.interrupted and s.eval_prompts > 0 else None
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
            f"{report['prompt_lookup_acceptance_length']:.2f}) on {report['answers']} held-out answers; speed-up over "
            f"greedy {report['speedup_vs_greedy']:.2f}x "
            f"(prompt lookup {report['prompt_lookup_speedup_vs_greedy']:.2f}x); "
            f"outputs identical to target greedy: {report['lossless']}; report {final_dir}/eval_acceptance.json")
        return report


# -----------------------------------------------------------------------------
# Main

def main(argv=None):
    try:
        settings = resolve_settings(parse_flags(argv))
        config = target_config(settings.target_model)
        settings = resolve_sharding(settings, config)
        if settings.plan:
            print(plan_text(memory_plan(settings, config), settings))
            return 0
        if cuda_devices(settings):
            check_memory_plan(settings, config)
        check_evaluation_fits(settings, config)
        return train(settings)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def train(settings):
    cluster = Cluster.from_env(settings.drafter_devices, settings.dist_timeout)
    trainer = Trainer(settings, cluster)
    rc = 0
    try:
        if trainer.load_data():
            trainer.load_models()
            trainer.train()
            rc = trainer.finish()
    finally:
        trainer.close()
    if rc == 0:  # after a failure a collective may still wait in a worker thread: exiting tears it down
        cluster.close()
    return rc


if __name__ == "__main__":
    sys.exit(main())
