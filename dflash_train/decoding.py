"""Batched decoding: many rows at once over one KV cache; plain generation, lossless speculative
decoding with a drafter, and prompt lookup (n-gram drafting, the free baseline).

Prompts are left-padded to the batch's longest, so row r's token at position p lives in cache
slot pad[r] + p. A step appends q tokens to every row right after the row's verified ones, at
its own slots and RoPE positions; what the row does not keep (rejected drafts) is excluded by
the mask and written over by the next step. Every shape stays fixed, so a step can be replayed
as a CUDA graph. Plain generation runs it with q = 1 (regeneration, greedy references); batched
speculative decoding with q = block size (verification), the drafter's context cache sharing
the target's slots.
"""

import collections
import functools
import inspect
import itertools

import numpy as np
import torch
import torch.nn.functional as F

from dflash_train.helpers import block_mask_of_tiles, sdpa_attend, text_config
from dflash_train.target_model import attention_implementation, collect_layer_outputs, register_flex_attention, \
    target_windows


def kv_layout(config):
    """(layers, kv heads, head dim) of a decoder config."""
    tc = text_config(config)
    heads = tc.num_attention_heads
    return (tc.num_hidden_layers, getattr(tc, "num_key_value_heads", None) or heads,
            getattr(tc, "head_dim", None) or tc.hidden_size // heads)


def check_batchable(config):
    """ValueError naming what the batched decoder cannot compute exactly for this target:
    sliding-window attention (per layer type, or a plain window on every layer), multi-head latent
    attention (its KV cache is not keys and values per head)."""
    tc = text_config(config)
    if target_windows(tc)[0] is not None:
        raise ValueError(f"{type(tc).__name__} has sliding-window attention: the batched decoder does not apply it")
    if getattr(tc, "kv_lora_rank", None):
        raise ValueError(f"{type(tc).__name__} has multi-head latent attention: the batched decoder does not "
                         "handle its KV cache")


def cache_kwarg(model):
    # transformers renamed past_key_values to cache (5.2x); accept both.
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def write_slots_(cache, slots, new):
    """cache [B, heads, S, D] <- new [B, heads, q, D] at slots: [q] (every row) or [B, q] (per row)."""
    if slots.dim() == 1:
        cache.index_copy_(2, slots, new.to(cache.dtype))
    else:
        cache.scatter_(2, slots[:, None, :, None].expand(new.shape), new.to(cache.dtype))


def _slot_cache_class():
    from transformers import DynamicCache

    class SlotCache(DynamicCache):
        """[rows, kv heads, slots, head dim] per layer, written at the slots `write_slots` (a device
        tensor set before each forward) of the rows `rows` (a slice)."""

        def __init__(self, config, batch, slots, dtype, device):
            super().__init__()
            n, kvh, hd = kv_layout(config)
            self.slot_keys = [torch.zeros(batch, kvh, slots, hd, dtype=dtype, device=device) for _ in range(n)]
            self.slot_values = [torch.zeros_like(k) for k in self.slot_keys]
            self.write_slots, self.rows, self.length = None, slice(None), 0

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # kwargs differ by version
            k, v = self.slot_keys[layer_idx][self.rows], self.slot_values[layer_idx][self.rows]
            write_slots_(k, self.write_slots, key_states)
            write_slots_(v, self.write_slots, value_states)
            return k, v

        def get_seq_length(self, layer_idx=0):
            return self.length
    return SlotCache


def grouped_mask(mask, G):
    """[B, 1, q, S] -> [B, 1, G * q, S]: each query's mask repeated for the G query heads of a
    group, in grouped_attention's order (a group's heads, each with its q queries)."""
    B, _, q, S = mask.shape
    return mask[:, :, None].expand(B, 1, G, q, S).reshape(B, 1, G * q, S)


def grouped_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The target's attention while decoding: each group of query heads that shares a KV head
    runs as one head with group x q queries, so SDPA reads the cache as it is instead of copies
    repeated to every query head (what transformers' SDPA path does under an explicit mask).
    Registered with transformers as "dflash_decode"; same result as its SDPA attention."""
    B, H, q, D = query.shape
    G = H // key.shape[1]
    if G > 1:
        query = query.reshape(B, H // G, G * q, D)
        if attention_mask is not None and attention_mask.shape[1] == 1:
            attention_mask = grouped_mask(attention_mask, G)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(B, H, q, D).transpose(1, 2).contiguous(), None


@functools.cache
def _register_grouped_attention():
    from transformers import AttentionInterface
    AttentionInterface.register("dflash_decode", grouped_attention)
    return "dflash_decode"


def additive_mask(allowed, dtype):
    """[B, q, S] bool -> [B, 1, q, S] additive (finite minimum: a row that sees nothing stays finite)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, torch.finfo(dtype).min)[:, None]


def decode_block_mask(pad, verified, live, q, slots, tile=128):
    """flex_attention's BlockMask of a decode step of q tokens a row: row b's query i sees slots
    [pad[b], pad[b] + verified[b] + i], none if not live[b] (a finished row reads nothing). Of
    the slots' tiles, those outside a row's span are skipped and those inside its verified part
    need no mask, so a step reads what each row uses, not every slot of every row."""
    start = torch.arange(-(-slots // tile), device=pad.device) * tile
    end = (start + tile - 1).clamp(max=slots - 1)
    first, last = pad[:, None], (pad + verified + q - 1)[:, None]
    some = (start[None] <= last) & (end[None] >= first) & live[:, None]
    full = some & (start[None] >= first) & (end[None] <= (pad + verified)[:, None]) & (start + tile <= slots)[None]

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx >= pad[b]) & (kv_idx <= pad[b] + verified[b] + q_idx)

    return block_mask_of_tiles((some & ~full)[:, None, None], full[:, None, None], mask_mod, (q, slots), tile)


DECODE_ATTENTION = ("grouped", "model", "flex")


class RowSlots:
    """Where each of `batch` rows stands in `slots` cache slots (see the section comment): the
    slot of its position 0 (pad: prompts are left-padded), its verified tokens (next_pos), whether
    it still decodes (live). A captured step reads these buffers where they are: updated in place."""

    def __init__(self, batch, slots, device):
        self.B, self.S, self.device = batch, slots, device
        self.pad = torch.zeros(batch, dtype=torch.long, device=device)
        self.next_pos = torch.zeros(batch, dtype=torch.long, device=device)
        self.live = torch.ones(batch, dtype=torch.bool, device=device)
        self.slot = torch.arange(slots, device=device)

    def prompt_positions(self, P, pad=None):
        """[rows, P]: the positions of left-padded prompts of P slots (padding at position 0)."""
        pad = self.pad if pad is None else pad
        return (torch.arange(P, device=self.device)[None] - pad[:, None]).clamp(min=0)

    def verified(self):
        """[B, S]: the slots of each row's verified tokens."""
        return (self.slot[None] >= self.pad[:, None]) & (self.slot[None] < (self.pad + self.next_pos)[:, None])


class BatchDecoder(RowSlots):
    """A target decoding `batch` rows over `slots` cache slots (see the section comment). With
    graph=True (CUDA) each step width q is captured once as a CUDA graph and replayed. layer_ids:
    target layers whose outputs step() also returns (the drafter's context). decode_attention:
    the target's attention, by grouped_attention ("grouped"), the model's own ("model"), or in the
    steps flex_attention under decode_block_mask ("flex": reads only the slots each live row
    uses; prefills stay grouped)."""

    def __init__(self, model, batch, slots, layer_ids=(), graph=False, prefill_elements=2**27,
                 decode_attention="grouped"):
        check_batchable(model.config)
        if decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"decode attention {decode_attention!r}: one of {DECODE_ATTENTION}")
        p = next(model.parameters())
        super().__init__(batch, slots, p.device)
        self.model, self.dtype = model, p.dtype
        self.cache = _slot_cache_class()(model.config, batch, slots, p.dtype, p.device)
        self.layer_ids, self.kw = list(layer_ids), cache_kwarg(model)
        self.use_graph = graph and p.device.type == "cuda"
        self.attention = attention_implementation(
            model, model.config._attn_implementation if decode_attention == "model" else _register_grouped_attention())
        self.flex = decode_attention == "flex"
        self.step_attention = (attention_implementation(model, register_flex_attention()) if self.flex
                               else self.attention)
        self.prefill_elements = prefill_elements  # rows x prompt x slots per prefill chunk (mask memory)
        self.graphs = {}

    def _forward(self, ids, positions, slots, mask, attention, last_only=False):
        self.cache.write_slots = slots
        with collect_layer_outputs(self.model, self.layer_ids) as hidden, attention:
            # last_only: logits of the last position only (a prefill's [rows, P, vocab] would not fit)
            logits = self.model(input_ids=ids, position_ids=positions, attention_mask=mask,
                                use_cache=True, logits_to_keep=1 if last_only else 0, **{self.kw: self.cache}).logits
        return logits, (torch.cat(hidden, -1) if self.layer_ids else None)

    def prefill(self, prompts, rows=None):
        """Left-padded prompts (token lists) into slots [0, P) of every row (rows None: at most B
        prompts, missing rows repeat the first), or of the given rows only while the others keep
        their state (a finished row refilled). Returns (logits at each prompt's last token [n, V],
        features [n, P, F] or None)."""
        if rows is None:
            prompts = list(prompts) + [prompts[0]] * (self.B - len(prompts))
            rows = list(range(self.B))
        n, P = len(prompts), max(len(p) for p in prompts)
        if P > self.S:
            raise ValueError(f"a prompt of {P} tokens does not fit {self.S} cache slots")
        lengths = torch.tensor([len(p) for p in prompts])
        ids = torch.zeros(n, P, dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, P - len(p):] = torch.as_tensor(p)
        pad = (P - lengths).to(self.device)
        pos = self.prompt_positions(P, pad)
        ids = ids.to(self.device)
        # every row at once into the cache itself; some rows into a cache of their own, copied in after
        whole = list(rows) == list(range(self.B))
        cache = self.cache if whole else _slot_cache_class()(self.model.config, n, P, self.dtype, self.device)
        S = cache.slot_keys[0].shape[2]
        slot, slots = self.slot[:S], self.slot[:P]
        # causal, and nothing left of the row's first token
        allowed = (slot[None, None, :] <= slots[None, :, None]) & (slot[None, None, :] >= pad[:, None, None])
        main, self.cache = self.cache, cache
        cache.length = 0
        logits, hidden = [], []
        step = max(1, self.prefill_elements // (P * S))
        try:
            for r0 in range(0, n, step):
                part = slice(r0, min(n, r0 + step))
                cache.rows = part
                lg, ft = self._forward(ids[part], pos[part], slots, additive_mask(allowed[part], self.dtype),
                                       self.attention, last_only=True)
                logits.append(lg[:, -1])
                hidden.append(ft)
        finally:
            self.cache, cache.rows = main, slice(None)
        rows_t = torch.as_tensor(rows, device=self.device)
        if cache is not main:
            for big, small in zip(main.slot_keys + main.slot_values, cache.slot_keys + cache.slot_values):
                big[rows_t, :, :P] = small
        self.pad[rows_t] = pad
        self.next_pos[rows_t] = lengths.to(self.device)
        main.length = max(main.length, P)
        return torch.cat(logits), (torch.cat(hidden) if self.layer_ids else None)

    def release(self):
        """Lets go of the cache and the captured steps (the next decoder's memory)."""
        self.cache, self.graphs = None, {}

    def _step_eager(self, ids):
        q = ids.shape[1]
        positions = self.next_pos[:, None] + torch.arange(q, device=self.device)
        slots = self.pad[:, None] + positions  # [B, q]
        if self.flex:
            mask = decode_block_mask(self.pad, self.next_pos, self.live, q, self.S)
        else:
            slot = self.slot[None, None, :]
            allowed = (slot >= self.pad[:, None, None]) & (slot <= slots[:, :, None])
            mask = additive_mask(allowed, self.dtype)
        return self._forward(ids, positions, slots, mask, self.step_attention)

    def step(self, ids):
        """ids [B, q] right after each row's verified tokens; returns (logits [B, q, V], features
        [B, q, F] or None). Nothing is kept until advance(). The caller keeps every row within the
        cache: pad + verified tokens + q <= slots."""
        q = ids.shape[1]
        if not self.use_graph:
            return self._step_eager(ids)
        if q not in self.graphs:
            static = {"ids": ids.clone()}
            self._step_eager(static["ids"])  # warm-up: writes slots that the step rewrites
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # other threads may run CUDA work
                static["out"] = self._step_eager(static["ids"])
            self.graphs[q] = (graph, static)
        graph, static = self.graphs[q]
        static["ids"].copy_(ids)
        graph.replay()
        return static["out"]

    def advance(self, keep):
        """Each row keeps the first keep[r] (a [B] tensor) of the q tokens the last step appended."""
        self.next_pos += keep


class ModelDecoder(RowSlots):
    """The decoder for targets the batched decoder does not compute (check_batchable): the same
    interface as BatchDecoder (rows, slots, verified tokens, step and advance), but every step is
    the model's own forward, with its own attention and masks and no cache, over each live row's
    verified tokens and the step's q tokens. Exact for any architecture transformers runs;
    quadratic in an answer's length, so slower."""

    def __init__(self, model, batch, slots, layer_ids=()):
        super().__init__(batch, slots, next(model.parameters()).device)
        self.model, self.layer_ids = model, list(layer_ids)
        self.tokens = [[] for _ in range(batch)]  # each row's verified tokens
        self.last = None  # the last step's tokens, which advance() keeps some of

    def _forward(self, ids):
        """(logits [L, V], features [L, F] or None) of one row's tokens."""
        with collect_layer_outputs(self.model, self.layer_ids) as hidden:
            logits = self.model(input_ids=torch.tensor([ids], device=self.device), use_cache=False).logits[0]
        return logits, (torch.cat(hidden, -1)[0] if self.layer_ids else None)

    def prefill(self, prompts, rows=None):
        """As BatchDecoder.prefill: the prompts' logits at their last token [n, V] and features
        [n, P, F] left-padded to the longest (P), or None."""
        if rows is None:
            prompts = list(prompts) + [prompts[0]] * (self.B - len(prompts))
            rows = list(range(self.B))
        P = max(len(p) for p in prompts)
        if P > self.S:
            raise ValueError(f"a prompt of {P} tokens does not fit {self.S} cache slots")
        logits, hidden = [], []
        for r, prompt in zip(rows, prompts):
            lg, ft = self._forward(list(prompt))
            logits.append(lg[-1])
            if ft is not None:
                hidden.append(F.pad(ft, (0, 0, P - len(prompt), 0)))
            self.tokens[r] = list(prompt)
            self.pad[r], self.next_pos[r] = P - len(prompt), len(prompt)
        return torch.stack(logits), (torch.stack(hidden) if self.layer_ids else None)

    def release(self):
        self.tokens = [[] for _ in range(self.B)]

    def step(self, ids):
        """ids [B, q] right after each row's verified tokens; (logits [B, q, V], features [B, q, F]
        or None); a row that is not live gets zeros."""
        q, self.last = ids.shape[1], ids.tolist()
        logits, hidden = None, None
        for r, live in enumerate(self.live.tolist()):
            if not live:
                continue
            lg, ft = self._forward(self.tokens[r] + self.last[r])
            if logits is None:
                logits = lg.new_zeros(self.B, q, lg.shape[-1])
                hidden = None if ft is None else ft.new_zeros(self.B, q, ft.shape[-1])
            logits[r] = lg[-q:]
            if ft is not None:
                hidden[r] = ft[-q:]
        if logits is None:  # no live row: nothing is read
            V = text_config(self.model.config).vocab_size
            logits = torch.zeros(self.B, q, V, device=self.device)
        return logits, hidden

    def advance(self, keep):
        """Each row keeps the first keep[r] of the q tokens the last step appended."""
        for r, k in enumerate(keep.tolist()):
            self.tokens[r] += self.last[r][:k]
        self.next_pos += keep


def token_probs(logits, temperature, top_p=1.0):
    """[..., V] logits -> the distribution sampling draws from: softmax at the temperature, cut to
    the smallest set of tokens that reaches top_p (nucleus), renormalised."""
    probs = torch.softmax(logits.float() / temperature, -1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > top_p  # keep the smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def pick_tokens(logits, temperature=0.0, top_p=1.0, generator=None):
    """[B, V] -> [B]: greedy at temperature 0, else sampled (nucleus top_p)."""
    if temperature <= 0:
        return logits.argmax(-1)
    return torch.multinomial(token_probs(logits, temperature, top_p), 1, generator=generator).squeeze(-1)


def verify_block(logits, draft, proposed, temperature=0.0, top_p=1.0, generator=None):
    """(accepted drafts m [B], the target's next token [B]) of a verification step: logits [B, bs,
    V] at the block's positions (the anchor, then the drafts), draft [B, bs - 1] (deterministic
    proposals: a drafter's argmax, prompt lookup's n-gram), proposed [B] drafts a row holds.
    Greedy (temperature 0): the drafts that equal the target's argmax, then its argmax. Sampled,
    as vLLM verifies DFlash drafts: draft k is accepted with the target's probability of it, given
    the ones before were; after a rejection the next token is drawn from the target's distribution
    without the rejected token, renormalised, else from the target's distribution after the last
    draft. The tokens kept are then distributed as the target's own samples."""
    if temperature <= 0:
        pred = logits.argmax(-1)
        m = (draft == pred[:, :-1]).long().cumprod(-1).sum(-1).minimum(proposed)
        return m, pred.gather(1, m[:, None]).squeeze(1)
    probs = token_probs(logits, temperature, top_p)  # [B, bs, V]
    p_draft = probs[:, :-1].gather(-1, draft[..., None]).squeeze(-1)
    u = torch.rand(p_draft.shape, generator=generator, device=p_draft.device)
    m = (u < p_draft).long().cumprod(-1).sum(-1).minimum(proposed)
    p_next = probs.gather(1, m[:, None, None].expand(-1, 1, probs.shape[-1])).squeeze(1)  # [B, V]
    rejected = draft.gather(1, m.clamp(max=draft.shape[1] - 1)[:, None])
    residual = p_next.scatter(1, rejected, 0.0)
    usable = (m < proposed) & (residual.sum(-1) > 0)
    p_next = torch.where(usable[:, None], residual / residual.sum(-1, keepdim=True).clamp(min=1e-30), p_next)
    return m, torch.multinomial(p_next, 1, generator=generator).squeeze(-1)


def slots_for(prompt_len, new_slots, granule=256):
    """Cache slots for a batch: its longest prompt rounded up (few distinct shapes, few graphs),
    and the new tokens rounded up to 16 (aligned rows for the attention kernels)."""
    return -(-prompt_len // granule) * granule + -(-new_slots // 16) * 16


def length_batches(prompts, batch_size, slots_of, cache_bytes_per_slot, cache_budget):
    """Batches of prompt indices, by length (prompts of a batch pad to about the same length), of
    batch_size rows, fewer where the batch's KV cache (its slots_of(longest prompt) slots per row)
    would pass cache_budget bytes. Returns [(indices, rows, slots)]."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out, i = [], 0
    while i < len(order):
        rows = min(batch_size, len(order))  # no rows beyond the prompts there are
        while True:
            idx = order[i:i + rows]
            slots = slots_of(len(prompts[idx[-1]]))
            if rows == 1 or rows * slots * cache_bytes_per_slot <= cache_budget:
                break
            rows = max(1, rows // 2)
        out.append((idx, rows, slots))
        i += len(idx)
    return out


def cache_plan(model, cache_fraction=0.5):
    """(bytes per cache slot of one row, bytes the caches may take): a fraction of the free GPU
    memory, or unbounded on the CPU."""
    n, kvh, hd = kv_layout(model.config)
    p = next(model.parameters())
    per_slot = 2 * n * kvh * hd * p.element_size()
    budget = torch.cuda.mem_get_info(p.device)[0] * cache_fraction if p.device.type == "cuda" else float("inf")
    return per_slot, budget


def one_decoder_batch(prompts, batch_size, slots, cache_bytes_per_slot, cache_budget):
    """[(every prompt index, by length, rows, slots)]: all prompts in one decoder of batch_size
    rows (fewer where its cache would pass cache_budget), whatever the prompts' number, so calls
    with the same slots share one captured step."""
    rows = batch_size
    while rows > 1 and rows * slots * cache_bytes_per_slot > cache_budget:
        rows //= 2
    return [(sorted(range(len(prompts)), key=lambda i: len(prompts[i])), rows, slots)]


def decoder_batches(model, prompts, batch_size, new_slots, layer_ids=(), graph=True, decode_attention="grouped"):
    """(prompt indices, BatchDecoder) per cache shape: of length_batches(), where prompts of
    about the same length share a cache sized for them (the prompts of consecutive batches of
    the same shape share one decoder, the next shape's cache is allocated only after the last one
    is let go); with flex attention, which reads only the slots each row uses, one decoder for
    every prompt, its slots rounded to 1024 (few shapes to compile), its rows refilled across
    lengths."""
    try:
        check_batchable(model.config)
    except ValueError:  # the model's own forward decodes it, every prompt in one decoder
        yield sorted(range(len(prompts)), key=lambda i: len(prompts[i])), ModelDecoder(
            model, min(batch_size, len(prompts)), slots_for(max(map(len, prompts)), new_slots), layer_ids)
        return
    if decode_attention == "flex":
        plan = one_decoder_batch(prompts, batch_size, slots_for(max(map(len, prompts)), new_slots, granule=1024),
                                 *cache_plan(model))
    else:
        plan = length_batches(prompts, batch_size, lambda n: slots_for(n, new_slots), *cache_plan(model))
    groups = []
    for idx, rows, slots in plan:
        if groups and groups[-1][1:] == (rows, slots):
            groups[-1][0].extend(idx)
        else:
            groups.append((list(idx), rows, slots))
    decoder = None
    for idx, rows, slots in groups:
        if decoder is not None:  # the caller still holds it: its memory goes before the next is allocated
            decoder.release()
        decoder = BatchDecoder(model, rows, slots, layer_ids, graph, decode_attention=decode_attention)
        yield idx, decoder


def row_batches(groups):
    """(prompt indices, decoder) per batch of at most decoder.B prompts of each group."""
    for group, decoder in groups:
        for at in range(0, len(group), decoder.B):
            yield group[at:at + decoder.B], decoder


def cut_at_stop(tokens, stop, max_new_tokens):
    """(tokens through the first stop id, 'stop' | 'length')."""
    for i, t in enumerate(tokens[:max_new_tokens]):
        if t in stop:
            return tokens[:i + 1], "stop"
    return tokens[:max_new_tokens], "length"


@torch.no_grad()
def generate(model, prompts, max_new_tokens, stop_token_ids=(), batch_size=64, temperature=0.0, top_p=1.0,
             seed=0, graph=True, progress=None, decode_attention="grouped"):
    """Completions of every prompt (lists of token ids), in order: [(tokens, 'stop' | 'length')].
    Greedy at temperature 0 (equal to transformers' generate with do_sample=False), sampled
    otherwise (seeded). progress(rows_done, new_tokens) as rows finish. decode_attention: see
    BatchDecoder and decoder_batches."""
    stop = set(int(t) for t in stop_token_ids)
    dev = next(model.parameters()).device
    stop_t = torch.tensor(sorted(stop) or [-1], device=dev)
    gen = torch.Generator(device=dev).manual_seed(seed)
    results = [None] * len(prompts)
    for group, decoder in decoder_batches(model, prompts, batch_size, max_new_tokens, graph=graph,
                                           decode_attention=decode_attention):
        # Rows run continuously: every 16 steps (one host sync) the finished rows hand in their
        # outputs and take the group's next prompts, so the batch stays full while replies end
        # at different lengths.
        B, queue = decoder.B, collections.deque(group)
        owner = [queue.popleft() if queue else None for _ in range(B)]  # the prompt each row decodes
        filled = [r for r, i in enumerate(owner) if i is not None]  # the others are never read
        logits, _ = decoder.prefill([prompts[owner[r]] for r in filled], rows=filled)
        out = torch.zeros(B, max_new_tokens, dtype=torch.long, device=dev)
        count = torch.zeros(B, dtype=torch.long, device=dev)  # tokens each row has generated
        done = torch.tensor([i is None for i in owner], device=dev)
        rows = torch.arange(B, device=dev)

        def record(tok, which=None):  # the running rows (of `which`) take tok as their next token
            take = ~done if which is None else ~done & which
            at = count.clamp(max=max_new_tokens - 1)
            out[rows, at] = torch.where(take, tok, out[rows, at])
            count.add_(take.long())
            done.logical_or_(take & (torch.isin(tok, stop_t) | (count >= max_new_tokens)))

        tok = torch.zeros(B, dtype=torch.long, device=dev)
        tok[torch.tensor(filled, device=dev)] = pick_tokens(logits, temperature, top_p, gen)
        record(tok)
        for step in itertools.count(1):
            if step % 16 == 0:
                finished = [r for r, d in enumerate(done.tolist()) if d and owner[r] is not None]
                counts, tokens = count.tolist(), out[finished].tolist()
                for r, toks in zip(finished, tokens):
                    results[owner[r]] = cut_at_stop(toks[:counts[r]], stop, max_new_tokens)
                    if progress is not None:
                        progress(1, len(results[owner[r]][0]))
                    owner[r] = None
                refill = finished[:len(queue)]
                if refill:
                    for r in refill:
                        owner[r] = queue.popleft()
                    lg, _ = decoder.prefill([prompts[owner[r]] for r in refill], rows=refill)
                    r_t = torch.as_tensor(refill, device=dev)
                    count[r_t], done[r_t] = 0, False
                    tok[r_t] = pick_tokens(lg, temperature, top_p, gen)
                    record(tok, torch.isin(rows, r_t))  # the others have recorded theirs
                if all(o is None for o in owner):
                    break
            decoder.live.copy_(~done)
            logits, _ = decoder.step(tok[:, None])
            decoder.advance((~done).long())  # a finished row stays where it is
            tok = pick_tokens(logits[:, -1], temperature, top_p, gen)
            record(tok)
    return results


def lookup_proposal(seq, max_tokens, max_ngram=3):
    """Prompt-lookup drafting: the tokens that followed the most recent earlier occurrence of the
    sequence's last n tokens (n = max_ngram down to 1), up to max_tokens of them; [] if none."""
    arr = np.asarray(seq)
    for n in range(min(max_ngram, len(arr) - 1), 0, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == arr[-n:]).all(1))
        if len(hits):
            start = int(hits[-1]) + n
            return arr[start:start + max_tokens].tolist()
    return []


def lookup_accepted(ids, anchor, end, block_size):
    """Tokens greedy verification would gain drafting by prompt lookup at `anchor` of a known
    sequence (ids, a numpy array): 1 + the leading proposed tokens equal to ids[anchor + 1:end]."""
    proposal = lookup_proposal(ids[:anchor + 1], block_size - 1)
    truth = ids[anchor + 1:end][:len(proposal)]
    miss = np.flatnonzero(np.asarray(proposal[:len(truth)]) != truth)
    return 1 + (int(miss[0]) if len(miss) else len(truth))


class DrafterContext:
    """The drafter beside a BatchDecoder: its context keys/values per draft layer [B, kv heads,
    slots, head dim] at the target's slots (the rows' verified slots are what a block sees), and
    its drafting step, replayed as a CUDA graph with graph=True (CUDA)."""

    def __init__(self, drafter, decoder, graph=False):
        n, kvh, hd = kv_layout(drafter.config)
        shape = (decoder.B, kvh, decoder.S, hd)
        dt = drafter.fc.weight.dtype
        zeros = lambda: torch.zeros(shape, dtype=dt, device=decoder.device)
        self.kv = [(zeros(), zeros()) for _ in range(n)]
        self.drafter, self.decoder = drafter, decoder
        self.anchor = torch.zeros(decoder.B, dtype=torch.long, device=decoder.device)  # read by the captured step
        self.use_graph, self.graph = graph and decoder.device.type == "cuda", None

    def _draft(self):
        d, bs = self.decoder, self.drafter.block_size
        sees = torch.cat([d.verified(), torch.ones(d.B, bs, dtype=torch.bool, device=d.device)], 1)
        logits = self.drafter.draft_logits(self.kv, self.anchor, d.next_pos, sdpa_attend(sees[:, None, None, :]))
        return logits.argmax(-1)

    def draft(self, anchor):
        """Greedy drafts [B, bs - 1] of the blocks that start with anchor [B] at each row's next
        position."""
        self.anchor.copy_(anchor)
        if not self.use_graph:
            return self._draft()
        if self.graph is None:
            self._draft()  # warm-up
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.out = self._draft()
        self.graph.replay()
        return self.out  # overwritten by the next replay

    def write(self, target_hidden, positions, slots):
        """Context keys/values of the target features [B, q, F] at positions [B, q] into slots
        ([q], or [B, q] per row)."""
        d = self.drafter
        for (k, v), (nk, nv) in zip(self.kv, d.context_kv(target_hidden.to(d.fc.weight.dtype), positions)):
            write_slots_(k, slots, nk)
            write_slots_(v, slots, nv)


@torch.no_grad()
def speculative_generate(model, prompts, max_new_tokens, stop_token_ids=(), drafter=None, block_size=16,
                         batch_size=64, graph=True, max_ngram=3, progress=None, temperature=0.0, top_p=1.0, seed=0):
    """Speculative decoding of every prompt, batched: a DFlash drafter (drafter given) or prompt
    lookup (drafter None) proposes block_size - 1 tokens per row and step, the target verifies
    all rows' blocks in one forward, and each row keeps what verify_block accepts plus the
    target's next token: greedy at temperature 0 (the output equals greedy decoding), else
    sampled (seeded; distributed as the target's own sampling). Returns [(tokens, [tokens gained
    per step])] per prompt, in order.

    Convention (the servers' and the reference decoder's): a block starts at the token the target just chose (its hidden
    state unknown), the drafter's context is every token the target has verified."""
    stop = set(int(t) for t in stop_token_ids)
    bs = drafter.block_size if drafter is not None else block_size
    dev = next(model.parameters()).device
    stop_t = torch.tensor(sorted(stop) or [-1], device=dev)
    results = [None] * len(prompts)
    layer_ids = drafter.target_layer_ids if drafter is not None else ()
    # A row's last step starts before max_new_tokens verified tokens and keeps up to bs; a
    # finished row stays there while the others go on, its blocks written bs slots further.
    ctx = None
    for idx, decoder in row_batches(decoder_batches(model, prompts, batch_size, max_new_tokens + 2 * bs, layer_ids,
                                                    graph)):
        rows = [prompts[i] for i in idx]
        logits, hidden = decoder.prefill(rows)
        if drafter is not None:
            if ctx is None or ctx.decoder is not decoder:  # one per decoder: its captured step is reused
                ctx = None
                ctx = DrafterContext(drafter, decoder, graph)
            P = hidden.shape[1]
            ctx.write(hidden, decoder.prompt_positions(P), decoder.slot[:P])
        # Every row's state lives on the device (one host copy every 16 steps with a drafter,
        # every step with prompt lookup, whose proposals are made on the host): its tokens, how
        # many, whether it is done (a stop token or max_new_tokens), its gain at every step.
        B, j = decoder.B, torch.arange(bs, device=dev)
        gen = torch.Generator(device=dev).manual_seed(seed + idx[0])
        anchor = pick_tokens(logits, temperature, top_p, gen)
        out = torch.zeros(B, max_new_tokens + bs, dtype=torch.long, device=dev)
        out[:, 0] = anchor
        count = torch.ones(B, dtype=torch.long, device=dev)
        done = torch.isin(anchor, stop_t) | (torch.arange(B, device=dev) >= len(rows)) | (max_new_tokens <= 1)
        gains = torch.zeros(B, max_new_tokens, dtype=torch.long, device=dev)  # a step gains one token or more
        proposed = torch.full((B,), bs - 1, device=dev)  # a drafter proposes a whole block
        for step in range(max_new_tokens):
            if drafter is not None:  # each block sees its row's verified slots, and itself
                if step % 16 == 0 and bool(done.all()):
                    break
                draft = ctx.draft(anchor)
            else:
                host = torch.cat([out, count[:, None], done[:, None].long()], 1).tolist()
                if all(h[-1] for h in host):
                    break
                props = [[] if h[-1] else lookup_proposal(p + h[:h[-2]], bs - 1, max_ngram)
                         for p, h in zip(rows + [[]] * (B - len(rows)), host)]
                draft = torch.tensor([p + [0] * (bs - 1 - len(p)) for p in props], device=dev)
                proposed = torch.tensor([len(p) for p in props], device=dev)
            block_pos = decoder.next_pos[:, None] + j
            logits, hidden = decoder.step(torch.cat([anchor[:, None], draft], 1))
            m, target_next = verify_block(logits, draft, proposed, temperature, top_p, gen)
            if ctx is not None:  # all bs slots: those not kept are masked out and written over later
                ctx.write(hidden, block_pos, decoder.pad[:, None] + block_pos)
            live = ~done
            decoder.advance((m + 1) * live)  # the block's first token and its m accepted drafts; finished rows stay
            anchor = target_next
            # the row's new tokens: its m accepted drafts, then the target's own next one
            new = torch.cat([draft, anchor[:, None]], 1).scatter(1, m[:, None], anchor[:, None])
            kept = (j <= m[:, None]) & live[:, None]
            at = (count[:, None] + j).clamp(max=out.shape[1] - 1)
            out.scatter_(1, at, torch.where(kept, new, out.gather(1, at)))
            gains[:, step] = (m + 1) * live
            stops = kept & torch.isin(new, stop_t)
            count += torch.where(stops.any(1), stops.long().argmax(1) + 1, m + 1) * live
            done |= live & (stops.any(1) | (count >= max_new_tokens))
        counts, tokens, gained = count.tolist(), out.tolist(), gains.tolist()
        for r, i in enumerate(idx):
            results[i] = (cut_at_stop(tokens[r][:counts[r]], stop, max_new_tokens)[0], [g for g in gained[r] if g])
        if progress is not None:
            progress(len(rows), sum(len(results[i][0]) for i in idx))
    return results
