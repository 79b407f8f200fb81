"""What fits a GPU: the memory plan of each GPU from the configs alone, before anything loads, its
refusals and advice, and the warm-up's measurement of the largest token budget that fits."""

import collections
import functools
import json
import os

import torch

import dflash_model as dm
from dflash_train import helpers
from dflash_train.chat_data import UsageError
from dflash_train.evaluation import has_heldout_prompts
from dflash_train.target_model import decoder_layers
from dflash_train.target_stage import layers_run, stage_bounds
from dflash_train.helpers import cuda_only


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


@functools.cache
def drafter_parameters(config_json):
    """The drafter's parameter count of a drafter config (as JSON), built on the meta device (no
    memory), once a config: the nearest layout that fits tries many."""
    with torch.device("meta"):
        drafter = dm.DFlashDraftModel(dm.Qwen3Config.from_dict(json.loads(config_json)))
    return sum(p.numel() for p in drafter.parameters())


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


def memory_plan(settings):
    """{device: {part: bytes}} for every GPU of the layout (a device shared by both stages holds
    both). Bytes: bf16 target weights; the drafter's fp32 master weights, bf16 copy and gradient
    and AdamW's two fp32 moments (16 bytes a parameter), the frozen embedding and LM head copies;
    activations at the token budget."""
    s, config = settings, settings.target_config
    tc = helpers.text_config(config)
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
    drafter_params = drafter_parameters(drafter_cfg.to_json_string())
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


def fits(plan, settings):
    """Whether every GPU of the plan holds what it is given (its activations' estimate too)."""
    return all(sum(parts.values()) <= gpu_capacity(settings, d) for d, parts in plan.items())


def nearest_fit(settings):
    """The layout nearest the asked one whose plan fits every GPU, as the flags that differ, or
    None: the asked draft layers kept as long as anything fits, then more target stages (each a
    divisor of the target GPUs), the optimizer sharded, a smaller token budget (halved, down to
    one row), in that order of preference; fewer draft layers last (only where the target layers
    are the default spread, which follows them)."""
    s = settings
    keep = layers_run(helpers.text_config(s.target_config).num_hidden_layers, s.target_layer_ids,
                      s.distillation is not None)
    stage_counts = [k for k in range(s.target_stages, min(len(s.target_devices), keep) + 1)
                    if len(s.target_devices) % k == 0]
    shardings = [s.shard_optimizer] + ([True] if len(s.drafter_devices) > 1 and not s.shard_optimizer else [])
    budgets, b = [], s.token_budget
    while b >= s.max_length:
        budgets.append(b // s.max_length * s.max_length)
        b //= 2
    num_layers = helpers.text_config(s.target_config).num_hidden_layers
    drafts = [s.num_draft_layers] + (list(range(s.num_draft_layers - 1, 0, -1)) if s.target_layer_ids ==
                                     dm.default_target_layer_ids(num_layers, s.num_draft_layers) else [])
    for layers in drafts:
        ids = s.target_layer_ids if layers == s.num_draft_layers else dm.default_target_layer_ids(num_layers, layers)
        for stages in stage_counts:
            for shard in shardings:
                for budget in budgets:
                    candidate = s.replace(num_draft_layers=layers, target_layer_ids=ids, target_stages=stages,
                                          shard_optimizer=shard, token_budget=budget,
                                          rows_per_batch=budget // s.max_length)
                    if fits(memory_plan(candidate), candidate):
                        flags = [("--num-draft-layers", layers, s.num_draft_layers),
                                 ("--target-stages", stages, s.target_stages),
                                 ("--token-budget", budget, s.token_budget)]
                        out = [f"{flag} {new}" for flag, new, old in flags if new != old]
                        return " ".join(out + (["--shard-optimizer"] if shard and not s.shard_optimizer else []))
    return None


def plan_verdict(settings, plan):
    """(whether the asked layout fits, the one line that says so; where it does not, the nearest
    layout that does, as flags to paste)."""
    if not plan:
        return True, "plan: no GPU in this layout"
    if fits(plan, settings):
        device = max(plan, key=lambda d: sum(plan[d].values()) / gpu_capacity(settings, d))
        return True, (f"plan: fits every GPU (fullest: {device}, {sum(plan[device].values()) / GB:.1f} of "
                      f"{gpu_capacity(settings, device) / GB:.1f} GB)")
    over = [str(d) for d, parts in plan.items() if sum(parts.values()) > gpu_capacity(settings, d)]
    nearest = nearest_fit(settings)
    return False, (f"plan: does NOT fit {', '.join(over)}; " + (f"the nearest layout that fits: {nearest}" if nearest
                   else "no layout of these GPUs fits (more GPUs, or a smaller target or drafter)"))


def cuda_devices(settings):
    """The run's GPUs, target and drafter, each once."""
    return sorted(set(cuda_only(settings.target_devices + settings.drafter_devices)), key=str)


def check_memory_plan(settings):
    """Refuses, before anything loads, a layout whose exact parts (weights, optimizer state)
    alone do not fit a GPU, with the plan and what would fit; the activations' estimate is
    shown, and the warm-up measures them. A target the meta device cannot build is not planned
    (said), never refused for it."""
    try:
        plan = memory_plan(settings)
    except Exception as e:  # noqa: BLE001  (the warm-up still measures what fits)
        print(f"note: no memory plan for this target ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
        return None
    for device, parts in plan.items():
        exact = sum(b for part, b in parts.items() if part not in ESTIMATED)
        cap = gpu_capacity(settings, device)
        if exact <= cap:
            continue
        advice, s = [], settings
        config = s.target_config
        keep = layers_run(helpers.text_config(config).num_hidden_layers, s.target_layer_ids, s.distillation is not None)
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


def resolve_sharding(settings):
    """--shard-optimizer's default: on where the plan of the drafter GPUs (their activations'
    estimate included) does not fit with every worker keeping the whole optimizer state (said),
    off elsewhere: a split state costs a copy of each share to the other workers every step."""
    if settings.shard_optimizer is not None:
        return settings
    drafters = cuda_only(settings.drafter_devices)
    if len(settings.drafter_devices) < 2 or not drafters:
        return settings.replace(shard_optimizer=False)
    try:
        whole = memory_plan(settings.replace(shard_optimizer=False))
    except Exception:  # noqa: BLE001  (a target the meta device cannot build: check_memory_plan says so)
        return settings.replace(shard_optimizer=False)
    needed = any(sum(whole[d].values()) > gpu_capacity(settings, d) for d in drafters)
    if needed:
        print(f"note: --shard-optimizer on: the drafter GPUs' plan does not fit with the whole optimizer state on "
              f"each; the AdamW moments are split over the {len(settings.drafter_devices)} workers")
    return settings.replace(shard_optimizer=needed)


def whole_target_parameters(config):
    """The whole target's parameter count (target_parts'); None where the meta device cannot
    build it."""
    try:
        parts = target_parts(config)
    except Exception:  # noqa: BLE001  (any error of a model's own constructor)
        return None
    return sum(parts["layers"]) + parts["embed"] + parts["rest"] + parts["head"]


def decoding_bytes(params):
    """The bytes a device needs to decode with a whole target of params parameters: its bf16
    weights and a quarter more, plus 2 GB, for the decoder's cache and work."""
    return 1.25 * 2 * params + 2 * GB


def check_evaluation_fits(settings):
    """The evaluations (final, --eval-interval) decode with the whole target on one device: a
    GPU of the run (the final one after the target stage has let go of its replicas; those during
    the run beside everything the plan puts there), else the host in fp32. A target that fits
    neither is refused before training, naming why, rather than failing after its last step."""
    if not (settings.eval_prompts > 0 or settings.eval_interval > 0) or not has_heldout_prompts(settings):
        return
    params = whole_target_parameters(settings.target_config)
    if params is None:  # a target the meta device cannot build: the evaluation finds out
        return
    need = decoding_bytes(params)
    plan = memory_plan(settings) if cuda_devices(settings) else {}
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
