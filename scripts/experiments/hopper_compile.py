"""The block attention's Triton kernels compiled for an H100/H200 (sm_90) on a machine with no GPU:
Triton's compiler and ptxas (which triton ships) need none. Prints each kernel's SASS
instructions, registers and stack (spills) a thread (triton's cuobjdump and nvdisasm) and its
loads pipelined into shared memory (async copies in the TTGIR), for this
tree's dflash_model.py and any others given, at Qwen3-8B's 4 heads a KV head (--heads-per-kv)
and each kernel's rows a program as dm.BLOCK_ATTENTION_CONFIG sets them (--rows: all at that);
for the others also whether each kernel's PTX, debug information aside, is this tree's.

    python scripts/experiments/hopper_compile.py [--trees .ab/base/dflash_model.py,...]

tests/test_model.py compiles the same way, so a kernel that Triton's interpreter runs but the GPU
compiler rejects fails on the CPU too."""
import argparse, importlib.util, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
POINTERS = {**dict.fromkeys(("q", "k", "v", "out", "dout", "dq", "dk", "dv"), "*bf16"),
            **dict.fromkeys(("lse", "delta"), "*fp32"),
            **dict.fromkeys(("starts", "anchors", "first_block", "end_block"), "*i32")}


def compile_block_attention(dm, heads_per_kv, rows=None, block_size=16, head_dim=128):
    """{kernel name: compiled kernel} of dm's three block-attention kernels for sm_90, with
    dm.BLOCK_ATTENTION_CONFIG's keys, warps and stages and the row layout dm's launches use for
    `rows`, or for each kernel's configured rows if None (trees before the twenty-sixth session:
    one block a program, their only layout)."""
    c = dm.BLOCK_ATTENTION_CONFIG
    several = hasattr(dm, "_program_rows")
    out = {}
    for kernel, name in ((dm._block_attention_fwd, "fwd"), (dm._block_attention_bwd_block, "dq"),
                         (dm._block_attention_bwd_context, "dkdv")):
        program = (dm._program_rows(rows or c.get(f"{name}_rows", 64), heads_per_kv, block_size, head_dim) if several else
                   dict(G=heads_per_kv, BS=block_size, D=head_dim,
                        BLOCK_M=max(16, triton.next_power_of_2(heads_per_kv * block_size))))
        constexprs = dict(program, BLOCK_N=c[f"{name}_keys"])
        if "BLOCK_B" in kernel.arg_names:
            constexprs["BLOCK_B"] = dm._own_keys(program["P"], block_size) if several else dm._own_keys(block_size)
        signature = {n: "constexpr" if n in constexprs else POINTERS.get(n, "fp32" if n == "sm_scale" else "i32")
                     for n in kernel.arg_names}
        # As Triton's launcher specializes them: 16-byte aligned pointers, and integers that are
        # multiples of 16 (every stride, a multiple of head_dim; A and L; not the 8 KV heads).
        aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
                   if signature[n] not in ("constexpr", "fp32") and n != "NKV"}
        out[kernel.__name__] = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs,
                                                        attrs=aligned),
                                              target=GPUTarget("cuda", 90, 32),
                                              options=dict(num_warps=c[f"{name}_warps"], num_stages=c[f"{name}_stages"],
                                                           **getattr(dm, "TRITON_OPTIONS", {})))
    return out


def sass_summary(kernel):
    """(SASS instructions, registers a thread, stack bytes a thread) of a compiled kernel's cubin."""
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([os.path.join(tools, "nvdisasm"), f.name], capture_output=True, text=True, check=True).stdout
    regs, stack = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK"))
    # an instruction's line: its offset, then an opcode (a predicate first, maybe); not .byte data
    return sum(1 for line in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/\s+[@A-Z]", line)), regs, stack


def ptx_code(kernel):
    """A compiled kernel's PTX without its debug information (source lines, labels): equal for
    two trees when a change moved code around but not what the GPU runs."""
    ptx = kernel.asm["ptx"].split(".section\t.debug")[0]
    return "\n".join(line for line in ptx.splitlines() if not re.match(r"\s*(\.loc|\.file|//|\$L__)", line))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--trees", default="", help="comma list of other dflash_model.py files to compile beside this tree's")
    p.add_argument("--heads-per-kv", type=int, default=4)
    p.add_argument("--rows", type=int, default=None, help="every kernel's rows a program (default: each one's configured)")
    a = p.parse_args()
    first = {}  # this tree's kernels' PTX
    for i, path in enumerate([os.path.join(ROOT, "dflash_model.py")] + list(filter(None, a.trees.split(",")))):
        spec = importlib.util.spec_from_file_location(f"dflash_model_{i}", path)
        dm = importlib.util.module_from_spec(spec)
        sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
        spec.loader.exec_module(dm)
        for name, k in compile_block_attention(dm, a.heads_per_kv, a.rows).items():
            instructions, regs, stack = sass_summary(k)
            copies = k.asm["ttgir"].count("async_copy_global_to_local")  # loads pipelined into shared memory
            code = ptx_code(k)
            same = "" if i == 0 else "; the same PTX as this tree's" if code == first[name] else "; other PTX"
            first.setdefault(name, code)
            print(f"{path}: {name} ({k.metadata.num_warps} warps): {instructions} SASS instructions, {regs} registers, "
                  f"{stack} B stack a thread, {copies} async copies{same}", flush=True)


if __name__ == "__main__":
    main()
