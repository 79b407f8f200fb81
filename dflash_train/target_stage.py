"""The target stage: frozen target replicas (whole or split over GPUs) that turn packed batches
into the hidden states the drafter reads, only as deep as the deepest layer it reads; their
document masks, loading, warm-up and the check against the model's own forward."""

import contextlib
import copy
import itertools

import torch

import dflash_model as dm
from dflash_train import helpers
from dflash_train.chat_data import UsageError
from dflash_train.decoding import token_probs
from dflash_train.target_model import attention_implementation, collect_layer_outputs, decoder_layers, \
    register_flex_attention, resolve_model_path, target_flex_kernel_options, target_windows
from dflash_train.throughput import timed
from dflash_train.helpers import COMPILE_LOCK, copy_into, on_device
from dflash_train.helpers import budget_error


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

    return helpers.block_mask_of_tiles((some & ~full)[:, None], full[:, None], mask_mod, (L, L), tile)


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


def layers_run(num_layers, target_layer_ids, distillation):
    """How many decoder layers the target stage runs: up to the deepest the drafter reads; all of
    them with a distillation, whose distribution is the LM head's."""
    return num_layers if distillation else max(target_layer_ids) + 1


def stage_bounds(num_layers, stages):
    """[0, b1, ..., num_layers]: the first decoder layer of each of `stages` contiguous ranges, as
    equal in layer count as they go."""
    if not 1 <= stages <= num_layers:
        raise UsageError(f"--target-stages {stages}: a replica of {num_layers} decoder layers splits into 1 to "
                         f"{num_layers} stages")
    return [round(i * num_layers / stages) for i in range(stages + 1)]


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
    keep, prefix = helpers.text_config(config).num_hidden_layers, meta.base_model_prefix
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
        tc = helpers.text_config(model.config)
        self.final_softcap = getattr(tc, "final_logit_softcapping", None)  # Gemma's, on the LM head's logits
        # Sliding windows: targets with sliding-window layers among full ones (Gemma 3, Qwen2's
        # use_sliding_window) take one mask per layer type; a plain `sliding_window` with no layer
        # types (Mistral, Phi-3) windows every layer. A mask passed in replaces the model's own, so
        # the window must be in it, or the features silently differ from the model's.
        self.window_layers, self.sliding_window = target_windows(tc)
        # The flex BlockMask in the tiles of the kernel that reads it: a partly visible tile is
        # computed whole, so smaller tiles compute fewer masked pairs (docs/benchmarks.md)
        options = target_flex_kernel_options(self.devices[0], dm.attention_shape(tc)[2])
        self.mask_tile = helpers.flex_mask_tile(options)
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
        self.compiled_layers = False
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
        self.compiled_layers = on

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
        vocab = helpers.text_config(self.model.config).vocab_size
        return {"input_ids": torch.randint(0, vocab, (rows, length), device=dev),
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
    """The target stage's features of a packed row (the batch's row of the most documents, as
    training sees them) against the model's own forward of each document alone (transformers'
    attention and masks, no packing mask; the same stages where the replica is split): per layer
    the drafter reads, the largest relative error ||stage - forward|| / ||forward|| over the
    documents. A stage whose masks or kernels compute something else than the model (a window
    missed, a mask tile wrong, state carried across documents) shows here by layer."""
    r = max(range(len(batch["doc_ids"])), key=lambda i: len(set(batch["doc_ids"][i].tolist()) - {-1}))
    outputs = replica.outputs({k: batch[k][r:r + 1] for k in TARGET_INPUTS})["target_hidden"][0].float()
    doc_ids = batch["doc_ids"][r]
    n = len(replica.target_layer_ids)
    errors = [0.0] * n
    for doc in doc_ids.unique().tolist():
        if doc < 0:  # padding
            continue
        at = (doc_ids == doc).nonzero()[:, 0]
        alone = replica.forward(batch["input_ids"][r, at][None], None, None, packed=False)["target_hidden"][0].float()
        width = outputs.shape[-1] // n
        for i in range(n):
            got = outputs[at.to(outputs.device), i * width:(i + 1) * width]
            want = alone[:, i * width:(i + 1) * width].to(got.device)
            errors[i] = max(errors[i], ((got - want).norm() / want.norm().clamp(min=1e-12)).item())
    return dict(zip(replica.target_layer_ids, errors))



def tolerance(dtype):
    """The largest relative error (stage_against_transformers) a stage computing the model's own
    features shows: fp32 paths agree to rounding; in bf16 rounding alone moves a path's features
    about 2% from fp32's, so two bf16 paths (flex against SDPA, stacked MLPs against plain) part by
    a few percent. A stage that misses what the model computes (a window, a document boundary)
    is off by tens of percent."""
    return 1e-4 if dtype == torch.float32 else 0.08


def check_against_transformers(replica, batch):
    """The guarantee every run starts with, for every architecture, listed or not: the stage's
    features of a packed row of the batch (its dtype, attention path and stages) against the
    model's own forward of each document alone (stage_against_transformers). A layer off by more
    than tolerance() refuses the run, naming the layers and the largest error. The layers run
    uncompiled here (the compiled ones are the same layers, checked equal in the tests), so the
    check costs no compilation at other shapes. Returns {layer: relative error}."""
    compiled = replica.compiled_layers
    replica.set_compiled_layers(False)
    try:
        errors = stage_against_transformers(replica, batch)
    finally:
        replica.set_compiled_layers(compiled)
    limit = tolerance(replica.dtype)
    wrong = {layer: round(e, 5) for layer, e in errors.items() if not e <= limit}
    if wrong:
        raise UsageError(f"the target stage's features differ from the model's own forward of each document alone "
                         f"by more than {limit:g} (relative) at target layers {wrong} (largest "
                         f"{max(wrong.values()):.3g}): this target computes something across packed documents that "
                         "the stage does not keep apart (recurrent or convolution state, attention sinks, "
                         "soft-capping, a window), so its hidden states would not be the ones a server shows the "
                         "drafter; it is refused")
    return errors


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
                         distillation=None, stages=1, config=None):
    """One frozen replica per `stages` consecutive target devices (one device each: a replica
    whole; several: split into as many contiguous layer ranges, TargetStage), with only the
    decoder layers up to the deepest one the drafter reads (all of them and the LM head with a
    distillation: its distribution is the LM head's). The weights load shard by shard straight
    onto the device that holds them (transformers' device_map), never the whole model in host
    memory. Also returns the target's embedding module and LM head weight (CPU copies) for the
    drafters. config: the target's, where it has been read (Settings.target_config)."""
    from transformers import AutoConfig
    path = resolve_model_path(name)
    dtype = torch.bfloat16 if devices[0].type == "cuda" else torch.float32
    config = copy.deepcopy(config) if config is not None else AutoConfig.from_pretrained(path)  # cut to the layers
    n_layers = helpers.text_config(config).num_hidden_layers
    keep = layers_run(n_layers, target_layer_ids, distillation is not None)
    tied = getattr(config, "tie_word_embeddings", False)
    slice_layers(helpers.text_config(config), 0, keep)
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

