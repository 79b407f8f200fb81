"""The command line and the run's Settings: every flag checked and every derived value resolved
once (layout, target layers, attention paths, optimizer sharding, the memory plan's checks),
before any model loads, then frozen."""

import argparse
import os

import torch

import dflash_model as dm
from dflash_train import helpers
from dflash_train import kernels as kn
from dflash_train.chat_data import UsageError, parse_chat_template_kwargs, parse_data_fields
from dflash_train.demo_assets import BUILTIN_DATA, BUILTIN_MODEL, BUILTIN_REGENERATED
from dflash_train.target_model import resolve_model_path
from dflash_train.kernels import triton
from dflash_train.memory_plan import check_evaluation_fits, check_memory_plan, cuda_devices, resolve_sharding
from dflash_train.target_stage import layers_run, stage_bounds


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
# train with --compile for a fixed 6,000 steps (whatever the data holds), evaluate on the 80
# MT-Bench questions (both turns) against prompt lookup. Where its settings differ from the 8B
# recipe (lr, the peak held until the last 20%, loss gamma 3: a drafter this weak seldom reaches
# its late slots) they measured better on this target; anchors, block size and draft layers stay
# the 8B recipe's, as nothing tried beat them at equal steps or minutes: docs/recipe.md.
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

def rounded_token_budget(flags, quiet=False):
    """--token-budget rounded down to a multiple of --max-length (said, where it changes)."""
    budget = flags.token_budget // flags.max_length * flags.max_length
    if budget != flags.token_budget and not quiet:
        print(f"note: --token-budget {flags.token_budget} rounded down to {budget} (a multiple of --max-length)")
    return budget


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
    for flag, path, needs in (("--init-drafter", flags.init_drafter, ("config.json", "model.safetensors")),
                              ("--resume", None if flags.resume == "auto" else flags.resume,
                               ("training_state.pt", "model.safetensors"))):
        missing = [f for f in needs if path and not os.path.isfile(os.path.join(path, f))]
        if missing:
            what = "a drafter" if flag == "--init-drafter" else "a checkpoint"
            raise UsageError(f"{flag} {path}: not {what} directory (no {' or '.join(missing)})")
    if flags.eval_data and not os.path.isfile(flags.eval_data):
        raise UsageError(f"--eval-data {flags.eval_data}: no such file (the held-out prompts, JSONL)")
    if flags.resume and flags.overwrite:
        raise UsageError("--resume continues the run in --output-dir, --overwrite replaces it: give one of them")


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
      shard_optimizer    a bool (--shard-optimizer, or on where the memory plan needs it)
      target_config      the target's transformers config, read once

    What the data stage derives from the data (its files, the mask token) travels in its result
    (batches.TrainingData), not here; mask_token_id here is the flag's (None: chosen there).

    Frozen: nothing changes a Settings once resolve_settings returns it."""

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
    tc = helpers.text_config(config)
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
    fits = gpu and kn.block_attention_fits(*dm.attention_shape(tc), block_size)
    if choice == "triton" and not fits:
        raise UsageError("--drafter-attention triton needs CUDA drafter GPUs, the triton package, head_dim a power "
                         "of two from 16 to 128 and at most 128 query heads x block slots per KV head")
    if choice != "auto":
        return choice
    if not gpu:
        return "sdpa"
    return "triton" if fits and all(helpers.hopper(d) for d in devices) else "flex"


def resolve_target_stage(flags, devices):
    """(target attention, compile the target's layers) as --target-attention and --compile-target
    say, their defaults resolved for the devices. flex_attention and inductor pay off on GPUs
    (docs/benchmarks.md); on CPU their eager and compiled forms are slower than SDPA."""
    gpu = devices[0].type == "cuda"
    attention = flags.target_attention if flags.target_attention != "auto" else ("flex" if gpu else "dense")
    compile_layers = flags.compile_target if flags.compile_target is not None else bool(flags.compile and gpu)
    return attention, compile_layers


def resolve_settings(flags):
    """The run's final Settings from the command line's flags: every flag checked; the target's
    config read (once: it travels in the Settings); the layout, target layers, attention paths,
    derived sizes and the optimizer's sharding resolved; and the checks of what must fit (the
    memory plan, the evaluations' whole target) made, before any model loads. Every entry point
    (the trainer, the smoke test) starts from it. With --plan the memory plan is left to print,
    whether it fits or not."""
    check_flags(flags)
    target_devices, drafter_devices = resolve_layout(flags)
    if flags.compile and any(d.type != "cuda" for d in drafter_devices):
        raise UsageError("--compile captures CUDA graphs and needs GPU drafter devices; drop it on CPU")
    if triton is None and any(d.type == "cuda" for d in drafter_devices) and not (flags.plan and flags.gpu_memory):
        raise UsageError("drafter workers on GPUs update their weights with a Triton kernel: install triton (CUDA "
                         "builds of torch bring it)")
    config = target_config(flags.target_model)
    tc = helpers.text_config(config)
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
    settings = resolve_sharding(Settings(**vars(flags)).replace(
        **derived_from_flags(flags), target_config=config, target_devices=target_devices,
        drafter_devices=drafter_devices, target_layer_ids=layer_ids, drafter_attention=drafter_attention,
        target_attention=target_attention, compile_target=compile_target))
    if not settings.plan:
        if cuda_devices(settings):
            check_memory_plan(settings)
        check_evaluation_fits(settings)
    return settings
