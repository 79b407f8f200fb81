"""Helpers every part of the tool shares: compiled functions, the GPU's kind, the compile lock,
copies between devices, flex_attention BlockMasks from tile maps, SDPA under a mask, the largest
batch that fits a GPU (measured), and signals caught for a clean stop."""

import contextlib
import functools
import math
import signal
import threading

import torch
import torch.nn.functional as F


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config



def ordered_blocks(blocks):
    """flex_attention's (num_blocks, indices) form of a [..., rows, cols] 0/1 block map: per row
    the count of set columns, and the column indices, set ones first, each part ascending. The
    same result as flex's stable argsort, by cumsum and scatter: a compiled argsort takes
    minutes to compile (pytorch/pytorch#182060)."""
    blocks = blocks.to(torch.int32)
    num = blocks.sum(-1, dtype=torch.int32)
    pos = torch.where(blocks.bool(), blocks.cumsum(-1) - 1, num[..., None] + (1 - blocks).cumsum(-1) - 1)
    cols = torch.arange(blocks.shape[-1], device=blocks.device, dtype=torch.int32).expand_as(pos)
    return num, torch.empty_like(pos, dtype=torch.int32).scatter_(-1, pos, cols)  # pos: a permutation per row


def block_mask_of_tiles(partial, full, mask_mod, seq_lengths, tile=128):
    """flex_attention's BlockMask from [B, H, query tiles, key tiles] maps of the tiles where
    mask_mod decides (partial) and those wholly visible (full); other tiles are skipped. tile:
    one size, or (query tile, key tile)."""
    from torch.nn.attention.flex_attention import BlockMask
    kv_num, kv_idx = ordered_blocks(partial)
    full_num, full_idx = ordered_blocks(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=tile, mask_mod=mask_mod,
                                    seq_lengths=seq_lengths, compute_q_blocks=False)



def sdpa_attend(mask):
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return attend


@functools.cache
def compiled(fn):
    """fn compiled once per process (fixed shapes); called eagerly, the compiled kernels run."""
    return torch.compile(fn, dynamic=False)



@torch.compiler.assume_constant_result  # read once while tracing a compiled step, not traced
def cuda_capability(device: str):
    return torch.cuda.get_device_capability(device)


def hopper(device):
    """Whether device is a Hopper GPU (sm90: H100, H200), where the kernel settings here were measured."""
    return device.type == "cuda" and cuda_capability(str(device)) == (9, 0)



def flex_mask_tile(kernel_options):
    """The tile of a BlockMask for flex_attention run with kernel_options: the smallest a whole
    number of the kernel's query and key tiles fill (flex needs that), since a partly visible tile
    is computed whole and then masked: at the causal diagonal and a document's edges a smaller tile
    computes fewer pairs that no query sees. 128 (flex's default) for a tile inductor chooses: a
    multiple of any it takes."""
    options = kernel_options or {}
    return math.lcm(options.get("BLOCK_M", 128), options.get("BLOCK_N", 128))



def compute_dtype(device, default):
    """The dtype autocast computes in on device where it is on, else default."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else default



def process_umask():
    """The process's file-creation mask (read, not set: setting it races other threads)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        return 0o022


def cuda_only(devices):
    return [d for d in devices if d.type == "cuda"]


# torch.compile (dynamo, inductor, flex_attention's own compile) is not thread-safe, and only
# one CUDA graph capture may be underway in a process: all of it happens under this lock.
COMPILE_LOCK = threading.Lock()


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


@contextlib.contextmanager
def signals_handled(handler, signals=(signal.SIGINT, signal.SIGTERM)):
    """Inside, the signals (SIGINT and SIGTERM) call handler(signum) instead of ending the process
    (in the main thread; elsewhere signals cannot be caught and nothing changes); the old handlers
    after, however the block ends. A handler that raises (KeyboardInterrupt, say) stops the block."""
    in_main = threading.current_thread() is threading.main_thread()
    old = {s: signal.signal(s, lambda signum, frame: handler(signum)) for s in signals} \
        if in_main else {}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
