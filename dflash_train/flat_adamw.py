"""The drafter's weights, gradients and AdamW state in flat buffers, for a training step that is
one CUDA graph: every gradient is a view of one flat buffer (averaging and clipping are one op
each), the backward writes each weight's gradient straight into its view (GradInto, and the
inductor pass WeightGradsIntoBuffer that makes the matmul itself write it), and one Triton
kernel updates every parameter (FlatAdamW).
"""

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from dflash_train.kernels import TRITON_OPTIONS, tl, triton


class GradInto(torch.autograd.Function):
    """A parameter, as itself or as its bf16 copy; in the backward its gradient is copied into
    `into`, its view of the flat gradient buffer, instead of accumulated into .grad. So the buffer
    needs no zeroing and no add per parameter; compiled, WeightGradsIntoBuffer has the matmul
    that makes a weight's gradient write it there itself.
    Every parameter gets a gradient every step (a test checks it), so no view keeps a stale one."""

    @staticmethod
    def forward(ctx, param, into, bf16=None):
        ctx.into = into  # not save_for_backward: each copy bumps the version counter all the views share
        value = param if bf16 is None else bf16  # the parameter itself, or its bf16 copy (FlatAdamW)
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        ctx.into.copy_(grad)
        return None, None, None


@torch.library.custom_op("dflash::mm_into", mutates_args=("out",))
def mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out = a @ b, written by the matmul itself (out: a contiguous view of a's dtype)."""
    torch.mm(a, b, out=out)


class WeightGradsIntoBuffer(CustomGraphPass):
    """Inductor pass on the compiled step's backward: GradInto's copy of a weight's gradient into its
    view of the flat buffer, `view.copy_(mm(a, b))`, becomes mm_into(a, b, view) where the two
    have one dtype and shape, so the matmul writes the gradient there and no copy kernel runs. A
    gradient that is a sum (k/v_proj, used twice) keeps its copy."""

    def __call__(self, graph):
        aten = torch.ops.aten
        for node in list(graph.nodes):
            if node.target is not aten.copy_.default or node.args[0].op != "placeholder":
                continue
            into, src = node.args
            mm = src.args[1] if src.target is aten.copy.default and src.args[0] is into else src
            if (mm.target is not aten.mm.default or len(mm.users) != 1 or len(src.users) != 1
                    or mm.meta["val"].shape != into.meta["val"].shape
                    or mm.meta["val"].dtype != into.meta["val"].dtype):
                continue
            with graph.inserting_before(node):
                graph.call_function(torch.ops.dflash.mm_into.default, (*mm.args, into)).meta["val"] = None
            for n in dict.fromkeys((node, src, mm)):
                graph.erase_node(n)

    def uuid(self):
        return get_hash_for_files((__file__,))


if triton is not None:
    @triton.jit
    def _adamw_kernel(param, grad, exp_avg, exp_avg_sq, weight_bf16, clip, coef, n, beta1, beta2, eps,
                      BLOCK: tl.constexpr):
        # torch's single-tensor AdamW, op for op (lerp, addcmul, addcdiv), on a clipped gradient;
        # coef: (step size lr / (1 - beta1^t), sqrt(1 - beta2^t), 1 - lr * weight decay)
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        step_size, bc2_sqrt, decay = tl.load(coef), tl.load(coef + 1), tl.load(coef + 2)
        g = tl.load(grad + i, mask=ok).to(tl.float32) * tl.load(clip)
        p = tl.load(param + i, mask=ok) * decay
        m = tl.load(exp_avg + i, mask=ok)
        m = m + (1 - beta1) * (g - m)
        v = tl.load(exp_avg_sq + i, mask=ok) * beta2 + (1 - beta2) * g * g
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = p - step_size * tl.div_rn(m, denom)
        tl.store(param + i, p, mask=ok)
        tl.store(exp_avg + i, m, mask=ok)
        tl.store(exp_avg_sq + i, v, mask=ok)
        tl.store(weight_bf16 + i, p.to(tl.bfloat16, fp_downcast_rounding="rtne"), mask=ok)


def flat_views(flat, params):
    """Views of the flat buffer `flat` shaped as each of params, in order: the one layout of the
    drafter's gradients, weights, moments and bf16 copies."""
    views, at = [], 0
    for p in params:
        views.append(flat[at:at + p.numel()].view_as(p))
        at += p.numel()
    return views


class FlatAdamW(torch.optim.AdamW):
    """torch's AdamW (its update, its state_dict) whose parameters and moments are views of flat
    fp32 buffers, updated by one Triton kernel that also writes the bf16 copy of the weights the
    step's matmuls read (`bf16_weights`, what autocast would cast them to). One launch, against
    the fused AdamW's 51 over 58 tensors, and no cast of each weight in every forward. The update
    takes the clip as a factor on the gradient, which it reads in its buffer's dtype (bf16 in the
    worker) and updates in fp32. Whoever writes the parameters other than by step() calls
    weights_changed(). A weight used twice in a step (k/v_proj: context and block) gets its two
    gradients summed in bf16, one bf16 rounding more than autocast's per-use casts (compiled,
    inductor folds the sum into the second matmul)."""

    BLOCK, WARPS = 1024, 4  # the fastest of 5 settings (scripts/experiments/flat_adamw.py)

    def __init__(self, params, flat_grad, lr, weight_decay, flat_param=None, weight_bf16=None):
        """flat_param, weight_bf16: the buffers (views) to keep the fp32 weights and their bf16
        copy in, holding params' values; by default its own, filled from params."""
        params = list(params)
        super().__init__(params, lr=lr, weight_decay=weight_decay, capturable=True, foreach=False)
        self.flat_grad = flat_grad
        self.flat_param = torch.cat([p.detach().reshape(-1) for p in params]) if flat_param is None else flat_param
        self.exp_avg, self.exp_avg_sq = torch.zeros_like(self.flat_param), torch.zeros_like(self.flat_param)
        self.weight_bf16 = torch.empty_like(self.flat_param, dtype=torch.bfloat16) if weight_bf16 is None \
            else weight_bf16
        self.steps = torch.zeros(len(params), device=flat_grad.device)  # one per parameter, as torch keeps them
        for p, view in zip(params, flat_views(self.flat_param, params)):
            p.data = view
        self.bf16_weights = flat_views(self.weight_bf16, params)
        self.state_in_buffers()
        self.weights_changed()

    def state_in_buffers(self):
        """Each parameter's state: its step count and its views of the moment buffers."""
        params = self.param_groups[0]["params"]
        moments = zip(flat_views(self.exp_avg, params), flat_views(self.exp_avg_sq, params))
        for p, step, (m, v) in zip(params, self.steps, moments):  # steps[i]: a view, counted in place
            self.state[p] = {"step": step, "exp_avg": m, "exp_avg_sq": v}

    def weights_changed(self):
        self.weight_bf16.copy_(self.flat_param)

    def load_state_dict(self, state_dict):
        """Loads as torch's does (any AdamW's state_dict), then copies the moments and step counts
        into the flat buffers, so the kernel's views are the state again."""
        super().load_state_dict(state_dict)
        params = self.param_groups[0]["params"]
        loaded = [self.state[p] for p in params]
        self.state_in_buffers()
        for p, st in zip(params, loaded):
            for key, buf in self.state[p].items():
                buf.copy_(st[key]) if key in st else buf.zero_()
        if not torch.all(self.steps == self.steps[0]):
            raise ValueError("optimizer state: the parameters have different step counts")

    @torch.no_grad()
    def step(self, clip):
        group = self.param_groups[0]
        beta1, beta2 = group["betas"]
        self.steps += 1
        t, lr = self.steps[0].double(), torch.as_tensor(group["lr"], device=self.steps.device).double()
        coef = torch.stack([lr / (1 - beta1 ** t), (1 - beta2 ** t).sqrt(), 1 - lr * group["weight_decay"]]).float()
        n = self.flat_param.numel()
        _adamw_kernel[(triton.cdiv(n, self.BLOCK),)](
            self.flat_param, self.flat_grad, self.exp_avg, self.exp_avg_sq, self.weight_bf16, clip, coef, n,
            beta1, beta2, group["eps"], BLOCK=self.BLOCK, num_warps=self.WARPS, **TRITON_OPTIONS)
