"""Optimizers whose step is one C call per parameter group.

    opt = opforge.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)

``AdamW`` is ``torch.optim.AdamW`` (amsgrad=False) with its update in C: ``step()`` gathers each
group's parameters that have a gradient and calls ``torch.ops.opforge.adamw_step`` once with the
lists, which increments the step counts and updates every parameter, ``exp_avg`` and ``exp_avg_sq``
in one pass over memory, the group's tensors split over torch's intra-op threads as one range
(csrc/kernels/adamw.c). For float32 parameters the result is torch's fused AdamW, bit for bit on
all but the last (numel % 16) elements of a tensor (there, torch's scalar tail rounds
``exp_avg_sq`` differently: an ulp). bfloat16 parameters keep their moments in float32, not in the
parameter's dtype as torch does (see the class docstring).
"""

from __future__ import annotations

import functools
from itertools import chain

import torch

from ._runtime import namespace

__all__ = ["AdamW"]

_MOMENTS = ("exp_avg", "exp_avg_sq")


@functools.cache
def _adamw_step():
    """The op's C++ entry point (OpOverload._op: no Python frame per call)."""
    ops = getattr(torch.ops, namespace)
    if not hasattr(ops, "adamw_step"):
        raise RuntimeError(f"opforge.optim.AdamW: torch.ops.{namespace}.adamw_step is not registered: the op library "
                           "logged why when it loaded (csrc/torch/adamw.c)")
    return ops.adamw_step.default._op


def _scalar_dtype() -> torch.dtype:
    """The dtype of the step count, as torch.optim makes it (so that state dicts carry the same)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update (decoupled weight decay, ``maximize``), fused in C.

    Arguments as ``torch.optim.AdamW``; ``lr`` and ``betas`` are floats and ``amsgrad`` must be
    False (both refused otherwise, naming what to use instead); ``foreach`` and ``fused``, which pick
    among torch's kernels, are taken and change nothing (the step is this one fused kernel), and
    ``capturable`` / ``differentiable`` must be False. Parameters are float32 or bfloat16
    CPU tensors, dense (contiguous in any order of their dims) with gradients of the same layout;
    a parameter without a gradient is skipped, a sparse gradient refused.

    State per parameter as torch's: ``step`` (a 0-d float32 tensor), ``exp_avg`` and
    ``exp_avg_sq``, so that ``state_dict()`` loads into ``torch.optim.AdamW`` and back. The moments
    are float32 for bfloat16 parameters too: torch keeps them in bfloat16, where ``v * 0.999``
    rounds back to ``v`` (0.001 is below half a bfloat16 ulp) and the second moment never decays.
    Loading a state dict keeps float32 moments float32 (and widens bfloat16 ones); torch's
    ``AdamW`` rounds them to the parameter's dtype when it loads ours.
    The param groups carry torch's keys (``foreach``, ``fused``, ... at their defaults): torch's
    AdamW, given our state dict, runs as its default implementation.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None):
        # torch.optim.AdamW's implementation switches: foreach and fused choose among torch's kernels (this
        # step is one fused kernel whatever they say), so they are taken and the same step runs; capturable
        # and differentiable ask for what it does not do
        if capturable or differentiable:
            raise ValueError("opforge.optim.AdamW: capturable=True and differentiable=True are not supported (a CPU "
                             "step outside autograd): use torch.optim.AdamW for them")
        if amsgrad:
            raise ValueError("opforge.optim.AdamW: amsgrad=True is not supported (the fused step keeps no "
                             "max_exp_avg_sq): use torch.optim.AdamW(..., amsgrad=True, fused=True)")
        if isinstance(lr, torch.Tensor) or any(isinstance(b, torch.Tensor) for b in betas):
            raise ValueError("opforge.optim.AdamW: lr and betas must be floats, got a Tensor (tensor hyperparameters "
                             "serve CUDA graph capture, which this CPU optimizer does not do)")
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=maximize, foreach=None, capturable=False, differentiable=False, fused=None,
                        decoupled_weight_decay=True)
        super().__init__(params, defaults)
        _adamw_step()  # a library that could not register the op fails here, not at the first step

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:  # as torch's AdamW: a state dict of torch's Adam still decays decoupled
            group["decoupled_weight_decay"] = True

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step for every parameter with a gradient; returns closure()'s loss, if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict) -> None:
        if group["amsgrad"]:
            raise RuntimeError("opforge.optim.AdamW: a param group has amsgrad=True (from a loaded state dict?), "
                               "which it does not support: use torch.optim.AdamW")
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                raise RuntimeError("opforge.optim.AdamW does not support sparse gradients: use torch.optim.SparseAdam")
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(g)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        _adamw_step()(params, grads, exp_avgs, exp_avg_sqs, steps, float(group["lr"]), float(beta1), float(beta2),
                 float(group["eps"]), float(group["weight_decay"]), bool(group["maximize"]))
        # what the dispatcher does for an in-place ATen op: a tensor saved for backward and updated
        # since then fails at backward, as it would with torch's optimizers
        torch.autograd.graph.increment_version(params)

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, but the moments stay float32 (torch casts them to the parameter's dtype)."""
        moments = {pid: {k: v for k, v in s.items() if k in _MOMENTS and torch.is_tensor(v)}
                   for pid, s in state_dict["state"].items()}
        saved_ids = list(chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
        super().load_state_dict(state_dict)
        for pid, p in zip(saved_ids, chain.from_iterable(g["params"] for g in self.param_groups)):
            for k, v in moments.get(pid, {}).items():
                self.state[p][k] = v.to(device=p.device, dtype=torch.float32)
