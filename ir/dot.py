"""DOT pictures of a block graph: tensors, operations, and shards coloured by device.

Like the sharded Linear→ReLU figures of the Tapestry docs: each operation is a cluster of its
shards (index box and device), each tensor a node; edges follow the data. Ops with many shards
are summarised per device. ``render_svg`` runs Graphviz's ``dot`` when it is installed.
"""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter

from ir.graph import Graph
from ir.rewrites.substitute_attention import K_RELAYOUTS
from ir.zspace import ZRange

# ColorBrewer "Set3" (12 qualitative colours), repeated beyond 12 devices.
PALETTE = ["#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5",
           "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f"]
ROLE_STYLE = {"input": 'shape=box, style="rounded,filled", fillcolor="#e8f0fe"',
              "parameter": 'shape=note, style=filled, fillcolor="#f1f3f4"',
              "state": 'shape=note, style=filled, fillcolor="#fce8e6"',
              "intermediate": "shape=box, style=rounded",
              "output": 'shape=box, style="rounded,filled,bold", fillcolor="#e6f4ea"'}


def device_colour(device: int) -> str:
    return PALETTE[device % len(PALETTE)]


def _q(s: str) -> str:
    """A DOT string: backslashes and quotes escaped, line breaks as DOT's ``\\n``."""
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(g: Graph, max_shards: int = 16) -> str:
    """The DOT text of ``g``; ops with more than ``max_shards`` shards are summarised per device."""
    lines = ["digraph tapestry {", "  rankdir=LR; compound=true; fontname=Helvetica;",
             "  node [fontname=Helvetica, fontsize=10]; edge [color=\"#5f6368\"];"]
    for name, t in g.tensors.items():
        label = f"{name}\n{t.dtype}{list(t.shape)}"
        lines.append(f"  {_q('t:' + name)} [label={_q(label)}, {ROLE_STYLE.get(t.role, '')}];")
    for idx, name in enumerate(g.topo_order):
        o = g.ops[name]
        sig = g.signature(o)
        sh = o.shards
        kernel = o.kernel if o.kernel != "fused" else "fused[" + " → ".join(s["kernel"] for s in o.params["stages"]) + "]"
        if o.kernel == "attention":  # a substitution: say what it replaced, not its whole origin record
            kernel = attention_label(o.params)
        elif o.kernel == "einsum" and o.params.get("origin"):
            kernel = "einsum (reassociated)"
        elif o.kernel == "norm_matmul":
            kernel = f"norm_matmul[{o.params['norm']['kernel']} → {o.params['inner']['kernel']}]"
        lines.append(f"  subgraph cluster_{idx} {{")
        title = f"{name}: {kernel}  dims {list(sig.dims)}"
        lines.append(f"    label={_q(title)}; style=rounded; color=\"#9aa0a6\";")
        anchor = None
        if len(sh) <= max_shards:
            for i in range(len(sh)):
                node = f"s:{name}:{i}"
                box = ZRange(sh.lo[i], sh.hi[i])
                dev = int(sh.device[i])
                label = f"{box!r}\ndevice {dev}"
                lines.append(f"    {_q(node)} [label={_q(label)}, shape=box, style=filled, "
                             f"fillcolor={_q(device_colour(dev))}];")
                anchor = anchor or node
        else:
            for dev, n in sorted(Counter(sh.device.tolist()).items()):
                node = f"s:{name}:d{dev}"
                label = f"{n} shards\ndevice {dev}"
                lines.append(f"    {_q(node)} [label={_q(label)}, shape=box, style=filled, "
                             f"fillcolor={_q(device_colour(dev))}];")
                anchor = anchor or node
        lines.append("  }")
        for port, t in o.inputs:
            lines.append(f"  {_q('t:' + t)} -> {_q(anchor)} [lhead=cluster_{idx}, label={_q(port)}, fontsize=8];")
        lines.append(f"  {_q(anchor)} -> {_q('t:' + o.output)} [ltail=cluster_{idx}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def attention_label(params: dict) -> str:
    """``attention[causal, split 4]  (was bmm → softmax → bmm)``: the fused op and what it replaced."""
    flags = (["causal" + (f"{params.get('offset', 0):+d}" if params.get("offset") else "")]
             if params.get("causal") else [])
    if params.get("split"):
        flags.append(f"split {params['split']['parts']}")
    label = "attention" + (f"[{', '.join(flags)}]" if flags else "")
    origin = params.get("origin")
    if origin:
        label += "  (was " + " → ".join(r["kernel"] for r in origin["ops"] if r["role"] not in K_RELAYOUTS) + ")"
    return label


class RenderError(RuntimeError):
    """Graphviz is missing or failed."""


def render_svg(dot_text: str, timeout: float = 120.0) -> str:
    """The SVG picture of a DOT text (Graphviz ``dot``); ``RenderError`` when it cannot be drawn
    (no ``dot``, a failure, or more than ``timeout`` seconds: a whole model's thousands of ops)."""
    exe = shutil.which("dot")
    if exe is None:
        raise RenderError("Graphviz's 'dot' is not installed (Debian: apt-get install graphviz); "
                          "write a .dot file instead")
    try:
        res = subprocess.run([exe, "-Tsvg"], input=dot_text, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RenderError(f"dot took more than {timeout:.0f} s to lay the graph out; write a .dot file "
                          "instead") from None
    if res.returncode != 0:
        raise RenderError(f"dot failed: {res.stderr.strip()[:500]}")
    return res.stdout
