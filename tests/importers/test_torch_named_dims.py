"""Named dims on the command line (``--example-input "x:int64[batch=8,seq=4096]"``): the module
is traced at small sizes with those dims symbolic and the program bound at the sizes given, so an
import costs a tiny forward whatever the batch and sequence. The program equals the one traced at
the full sizes (same digest), and an export that does not hold at other sizes (Python code
turning a size into a number) is refused by the check at other small sizes."""

from __future__ import annotations

import textwrap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnx")

from executor.run import execute  # noqa: E402
from ir.importers.errors import ImportFailure  # noqa: E402
from ir.importers.torch_export import import_torch_factory  # noqa: E402
from optimizer.cli import main  # noqa: E402
from optimizer.cli.import_cmds import _example_inputs  # noqa: E402

BLOCK = '''
import torch

class Block(torch.nn.Module):
    """Embedding, causal self-attention (SDPA), and (``branch``) a scale by the sequence length."""

    def __init__(self, branch=False):
        super().__init__()
        self.e = torch.nn.Embedding(50, 16)
        self.qkv = torch.nn.Linear(16, 48)
        self.out = torch.nn.Linear(16, 50)
        self.branch = branch

    def forward(self, ids):
        h = self.e(ids)
        b, s, _ = h.shape
        q, k, v = self.qkv(h).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = self.out(a.transpose(1, 2).reshape(b, s, 16))
        if self.branch:  # a size made a Python number: tracing records it as a constant
            return y * float(int(s))
        return y

def make():
    torch.manual_seed(0)
    return Block()

def make_fixed():
    torch.manual_seed(0)
    block = Block()
    forward = block.forward

    def only_seq_3(ids):
        assert ids.shape[1] == 3, "this model takes sequences of 3"
        return forward(ids)

    block.forward = only_seq_3
    return block

def make_branching():
    torch.manual_seed(0)
    return Block(branch=True)
'''


@pytest.fixture()
def block_file(tmp_path):
    p = tmp_path / "block.py"
    p.write_text(textwrap.dedent(BLOCK))
    return p


def test_named_dims_give_the_program_traced_at_full_size(block_file):
    full, fv = import_torch_factory(f"{block_file}:make", [("x", "int64", [4, 9])])
    named, nv = import_torch_factory(f"{block_file}:make", [("x", "int64", [("batch", 4), ("seq", 9)])],
                                     run=execute)
    assert named.tensors["x"].shape == (4, 9) and named.tensors["output"].shape == (4, 9, 50)
    assert named.digest == full.digest
    assert set(nv) == set(fv)


def test_a_size_made_a_constant_is_refused(block_file):
    with pytest.raises(ImportFailure, match="does not compute the module at other sizes") as e:
        import_torch_factory(f"{block_file}:make_branching", [("x", "int64", [("batch", 4), ("seq", 9)])],
                             run=execute)
    assert "batch=3, seq=4" in str(e.value) and "x:int64[8,128]" in str(e.value)
    g, _ = import_torch_factory(f"{block_file}:make_branching", [("x", "int64", [4, 9])])  # fixed sizes import
    assert g.tensors["x"].shape == (4, 9)
    with pytest.raises(ImportFailure, match="two sizes"):
        import_torch_factory(f"{block_file}:make", [("x", "int64", [("n", 4), ("n", 9)])], run=execute)
    with pytest.raises(ImportFailure, match="forward fails at other sizes of its named dims"):  # asserts seq 3
        import_torch_factory(f"{block_file}:make_fixed", [("x", "int64", [("batch", 4), ("seq", 9)])], run=execute)


def test_the_command_line_parses_named_dims(block_file, tmp_path, capsys):
    assert _example_inputs(["x:int64[batch=8, seq=4096]", "m:float32[8,3]"]) == [
        ("x", "int64", [("batch", 8), ("seq", 4096)]), ("m", "float32", [8, 3])]
    out = tmp_path / "p.json"
    with pytest.raises(SystemExit) as e:
        main(["import", f"{block_file}:make", "--example-input", "x:int64[batch=3,seq=40]", "-o", str(out)])
    assert e.value.code in (0, None) and out.exists()
    for bad in ("x:int64[batch=,8]", "x:int64[batch=0]", "x:int64[8=batch]"):
        with pytest.raises(SystemExit) as e:
            main(["import", f"{block_file}:make", "--example-input", bad, "-o", str(out)])
        assert e.value.code == 2
        assert "named dims" in capsys.readouterr().err
