"""Cases for the substitutions' kernels (fused attention and its backward, norm_matmul), with
references written here: attention with the
scores materialised (``scipy.special.softmax`` over a -inf mask), and the combine as a softmax
over the blocks' log-sum-exps. ``check_softmax_split`` is the split-reduction check for the
softmax monoid, whose partials carry one more channel than the output."""

from __future__ import annotations

import numpy as np
import scipy.special

from ir.kernels import get_kernel


def attention_ref(q, k, v, scale, causal=False, offset=0, bias=None):
    extra = q.ndim - k.ndim  # grouped-query heads: k and v broadcast over q's group dims
    k = k.reshape(k.shape[:-2] + (1,) * extra + k.shape[-2:])
    v = v.reshape(v.shape[:-2] + (1,) * extra + v.shape[-2:])
    s = scale * np.einsum("...se,...te->...st", q, k)
    if bias is not None:  # NumPy's broadcasting onto the scores
        s = s + bias
    if causal:
        keep = np.arange(k.shape[-2])[None, :] <= np.arange(q.shape[-2])[:, None] + offset
        s = np.where(keep, s, -np.inf)
    return np.einsum("...st,...te->...se", scipy.special.softmax(s, axis=-1), v)


def _layernorm(x, g, b, eps):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps) * g + b


def _scores(q, k, scale, causal, offset, bias=None):
    extra = q.ndim - k.ndim
    k = k.reshape(k.shape[:-2] + (1,) * extra + k.shape[-2:])
    s = scale * np.einsum("...se,...te->...st", q, k)
    if bias is not None:
        s = s + bias
    if causal:
        s = np.where(np.arange(k.shape[-2])[None, :] <= np.arange(q.shape[-2])[:, None] + offset, s, -np.inf)
    return s


def grad_ref(which, scale, causal=False, offset=0):
    """The backward formulas written out with einsums, for arbitrary o, dy and lse (FlashAttention
    Alg. 4: P = exp(S - L), D = rowsum(dy ∘ o), dS = P ∘ (dy·vᵀ - D)); dbias: dS summed down to the
    bias's shape."""
    def ref(i):
        q, k = i["q"], i["k"]
        extra = q.ndim - k.ndim
        ax = tuple(range(k.ndim - 2, q.ndim - 2))  # q's group dims, summed for k and v
        P = np.exp(_scores(q, k, scale, causal, offset, i.get("bias")) - i["lse"][..., None])
        if which == "v":
            return np.einsum("...st,...se->...te", P, i["dy"]).sum(axis=ax)
        v = i["v"].reshape(i["v"].shape[:-2] + (1,) * extra + i["v"].shape[-2:])
        kk = k.reshape(k.shape[:-2] + (1,) * extra + k.shape[-2:])
        dS = P * (np.einsum("...se,...te->...st", i["dy"], v) - (i["dy"] * i["o"]).sum(-1)[..., None])
        if which == "q":
            return scale * np.einsum("...st,...te->...se", dS, kk)
        if which == "bias":
            b = i["bias"]
            dS = dS.sum(axis=tuple(range(dS.ndim - b.ndim)))
            return dS.sum(axis=tuple(a for a, n in enumerate(b.shape) if n == 1), keepdims=True)
        return (scale * np.einsum("...st,...se->...te", dS, q)).sum(axis=ax)
    return ref


def attention_cases(Case):
    return [
        Case("attention", "attention", {"q": (2, 3, 5, 4), "k": (2, 3, 6, 4), "v": (2, 3, 6, 3)}, {"scale": 0.4},
             lambda i: attention_ref(i["q"], i["k"], i["v"], 0.4)),
        Case("attention_causal", "attention", {"q": (2, 5, 4), "k": (2, 6, 4), "v": (2, 6, 4)},
             {"scale": 0.5, "causal": True, "offset": 1},
             lambda i: attention_ref(i["q"], i["k"], i["v"], 0.5, True, 1)),
        Case("attention_gqa", "attention", {"q": (2, 2, 3, 4, 2), "k": (2, 2, 6, 2), "v": (2, 2, 6, 2)},
             {"scale": 1.0, "causal": True},
             lambda i: attention_ref(i["q"], i["k"], i["v"], 1.0, True, 0)),
        Case("attention_combine", "attention_combine", {"p": (3, 2, 4, 5)}, {},
             lambda i: (scipy.special.softmax(i["p"][..., -1], axis=0)[..., None] * i["p"][..., :-1]).sum(axis=0)),
        Case("attention_lse", "attention_lse", {"q": (2, 2, 5, 3), "k": (2, 6, 3)}, {"scale": 0.5, "causal": True},
             lambda i: scipy.special.logsumexp(_scores(i["q"], i["k"], 0.5, True, 0), axis=-1)),
        Case("norm_matmul", "norm_matmul", {"x": (4, 6), "n.gamma": (6,), "n.beta": (6,), "m.b": (6, 3)},
             {"norm": {"op": "ln", "kernel": "layernorm", "params": {"eps": 1e-3}, "output": "ln.out"},
              "inner": {"op": "mm", "kernel": "matmul", "params": {"alpha": 0.5}, "chain": "a"}},
             lambda i: 0.5 * _layernorm(i["x"], i["n.gamma"], i["n.beta"], 1e-3) @ i["m.b"]),
        Case("norm_matmul_rms_linear", "norm_matmul", {"x": (2, 3, 6), "n.gamma": (6,), "m.W": (6, 2), "m.b": (2,)},
             {"norm": {"op": "n", "kernel": "rmsnorm", "params": {}, "output": "n.out"},
              "inner": {"op": "l", "kernel": "linear", "params": {}, "chain": "x"}},
             lambda i: i["x"] / np.sqrt((i["x"] ** 2).mean(-1, keepdims=True) + 1e-6) * i["n.gamma"] @ i["m.W"]
             + i["m.b"]),
        *[Case(f"attention_grad_{w}", f"attention_grad_{w}",
               {"q": (2, 2, 5, 3), "k": (2, 6, 3), "v": (2, 6, 4), "o": (2, 2, 5, 4), "dy": (2, 2, 5, 4),
                "lse": (2, 2, 5)} if w != "v" else
               {"q": (2, 2, 5, 3), "k": (2, 6, 3), "dy": (2, 2, 5, 4), "lse": (2, 2, 5)},
               {"scale": 0.5, "causal": True, "offset": 1}, grad_ref(w, 0.5, True, 1)) for w in "qkv"],
        *bias_cases(Case),
    ]


#: (id, q, k, v, bias): the biases the attention kernels take (T5's [1, h, s, t] over grouped heads,
#: ALiBi's [b·h, 1, t], a padding mask [b, 1, 1, t], a missing leading dim [h, s, t])
BIASES = [("t5", (2, 2, 3, 5, 4), (2, 2, 6, 4), (2, 2, 6, 3), (1, 2, 3, 5, 6)),
          ("alibi", (6, 5, 4), (6, 6, 4), (6, 6, 3), (6, 1, 6)),
          ("padding", (2, 3, 5, 4), (2, 3, 6, 4), (2, 3, 6, 3), (2, 1, 1, 6)),
          ("heads", (2, 3, 5, 4), (2, 3, 6, 4), (2, 3, 6, 3), (3, 5, 6))]


def bias_cases(Case):
    """The attention kernels with a bias on the scores: the forward and every backward kernel."""
    out = []
    for bid, q, k, v, b in BIASES:
        causal = {"scale": 0.5, "causal": True, "offset": 1}
        out.append(Case(f"attention_bias_{bid}", "attention", {"q": q, "k": k, "v": v, "bias": b}, causal,
                        lambda i: attention_ref(i["q"], i["k"], i["v"], 0.5, True, 1, i["bias"])))
        o = q[:-1] + v[-1:]
        rows = {"q": q, "k": k, "v": v, "o": o, "dy": o, "lse": q[:-1], "bias": b}
        for w in ("q", "k", "v", "bias"):
            ins = rows if w != "v" else {p: rows[p] for p in ("q", "k", "dy", "lse", "bias")}
            out.append(Case(f"attention_grad_{w}_bias_{bid}", f"attention_grad_{w}", ins, causal,
                            grad_ref(w, 0.5, True, 1)))
        out.append(Case(f"attention_lse_bias_{bid}", "attention_lse", {"q": q, "k": k, "bias": b}, causal,
                        lambda i: scipy.special.logsumexp(_scores(i["q"], i["k"], 0.5, True, 1, i["bias"]), axis=-1)))
    return out


def check_softmax_split(case, sig, base, params, parts, whole, run_box, random_subbox, slice_of) -> None:
    """Attention's split key reduction: partials ``[kb, ..., ev + 1]`` combine back to the reference."""
    assert sig.out_spec.shape == (parts,) + base.out_spec.shape[:-1] + (base.out_spec.shape[-1] + 1,)
    assert sig.flops_per_point * sig.index.size == base.flops_per_point * base.index.size
    partials = run_box(case, sig, params, whole, sig.index)
    comb = get_kernel("attention_combine")
    np.testing.assert_allclose(comb.compute(np, {"p": partials}, {}), case.ref(whole), rtol=1e-10, atol=1e-12)
    rng = np.random.default_rng(2)
    for _ in range(10):
        box = random_subbox(rng, sig.index)
        np.testing.assert_allclose(run_box(case, sig, params, whole, box), slice_of(partials, box), rtol=1e-10,
                                   atol=1e-12, err_msg=str(box))
