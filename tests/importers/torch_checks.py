"""Checks that an imported PyTorch module computes and trains as torch does (helpers of the
importer tests: ``torch`` is None without it, and ``needs_torch`` skips a test then)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from executor.run import execute
from ir.autodiff import training_step

try:
    import torch
except ImportError:  # the ONNX tests run without torch
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="needs torch (pip install 'tapestry[torch]')")


def kernels_of(g) -> list[str]:
    """The kernels of ``g``'s ops, sorted (with repeats)."""
    return sorted(o.kernel for o in g.ops.values())


def net(act, d_in: int = 6, d_h: int = 8, d_out: int = 5):
    """``fc2(act(fc1(x)))``: the activation between two trained layers."""
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(d_in, d_h), torch.nn.Linear(d_h, d_out)

        def forward(self, x):
            return self.fc2(act(self.fc1(x)))

    return Net()


def torch_grads(m, loss_of) -> dict[str, np.ndarray]:
    """Every parameter's gradient of ``loss_of(m)`` by ``torch.autograd``, as float64."""
    m.zero_grad()
    loss_of(m).backward()
    return {n: p.grad.detach().numpy().astype(np.float64) for n, p in m.named_parameters()}


def check_against_torch(m, x, kernels, loss: str = "mse", labels=None, opset: int = 17,
                        batchnorm: str = "eval", reference=None) -> tuple[Any, dict]:
    """Forward equals the module's; the training step's gradients equal ``torch.autograd``'s for
    every parameter (``mse`` against a random target, or ``cross_entropy`` on given ``labels``,
    against ``nll_loss`` of the module's log-probabilities). ``batchnorm`` is ``import_torch``'s
    (``"train"``: give ``m`` in train mode, so torch's own forward uses batch statistics too).
    ``reference``: the module torch computes the forward and gradients with, when the import is
    meant to compute another than ``m`` (``m`` with its MoE blocks' balanced twins); its parameters
    must have ``m``'s names. Returns the graph and the step's values."""
    from ir.importers.torch_export import import_torch

    ref_m = m if reference is None else reference
    g, vals = import_torch(m, {"x": x}, opset=opset, batchnorm=batchnorm)
    assert set(kernels) <= set(kernels_of(g)), kernels_of(g)
    with torch.no_grad():
        ref = ref_m(x).numpy()
    got = execute(g, {**vals, "x": x.numpy()})["output"]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    step = training_step(g, loss=loss, optimizer="sgd")
    feed = {**vals, "x": x.numpy()}
    if loss == "mse":
        target = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7))
        feed["target"] = target.numpy()
        want = torch_grads(ref_m, lambda mod: torch.nn.functional.mse_loss(mod(x), target))
    else:
        feed["labels"] = labels.numpy().astype(np.int32)
        want = torch_grads(ref_m, lambda mod: torch.nn.functional.nll_loss(mod(x).reshape(-1, ref.shape[-1]),
                                                                            labels.reshape(-1)))
    env = execute(step, feed, precision="float64")
    for name, w in want.items():
        got_grad = env[f"{name}.grad"] if f"{name}.grad" in env else env[f"{name}.T.grad"].T
        assert np.abs(w).max() > 0, name  # a gradient that reaches this parameter at all
        np.testing.assert_allclose(got_grad, w, rtol=1e-4, atol=1e-6, err_msg=name)
    return g, env
