"""The sampling walk down draft trees: the Triton kernel (the CPU interpreter in CI) against the plain-PyTorch
reference, into poisoned output buffers (an entry the kernel never writes keeps its poison), and the child table
against a direct construction."""

import pytest
import torch

pytest.importorskip("triton")

from longspec.infer.accept import sample_path, target_distribution  # noqa: E402
from longspec.infer.tree import TreeLayout  # noqa: E402
from longspec.kernels.tree_sampling import child_table, sample_walk, sample_walk_naive  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _trees(widths, batch, vocab, generator, *, invalid=0.15):
    """Random trees of one layout (parents drawn from the level above, some nodes invalid), their tokens, and
    random p per node with a q close to it."""
    layout = TreeLayout(widths)
    parents = torch.full((batch, layout.num_nodes), -1, dtype=torch.long)
    for level in range(1, layout.depth + 1):
        here, above = layout.level_slice(level), layout.level_slice(level - 1)
        parents[:, here] = torch.randint(
            above.start, above.stop, (batch, here.stop - here.start), generator=generator
        )
    valid = torch.rand(batch, layout.num_nodes, generator=generator) > invalid
    valid[:, 0] = True
    tokens = torch.randint(0, vocab, (batch, layout.num_nodes), generator=generator)
    logits = torch.randn(batch, layout.num_nodes, vocab, generator=generator) * 4  # peaked: walks go deep
    noise = torch.randn(batch, layout.num_nodes, vocab, generator=generator)  # the drafter: q close to p
    p, q = (target_distribution(x, temperature=1.0) for x in (logits, logits + noise))
    return layout, parents.to(DEVICE), valid.to(DEVICE), tokens.to(DEVICE), p.to(DEVICE), q.to(DEVICE)


def test_child_table_lists_each_nodes_valid_children_in_order():
    generator = torch.Generator().manual_seed(0)
    layout, parents, valid, *_ = _trees((3, 4, 4), 4, 11, generator, invalid=0.3)
    table = child_table(parents, valid, 3).cpu()
    for b in range(4):
        for n in range(layout.num_nodes):
            kids = [i for i in range(1, layout.num_nodes) if parents[b, i] == n and valid[b, i]][:3]
            assert table[b, n].tolist() == kids + [-1] * (3 - len(kids)), (b, n)


@pytest.mark.parametrize("rule", ["rrs", "deterministic"])
@pytest.mark.parametrize("widths,vocab", [((2, 3, 2), 37), ((4, 4, 4), 300), ((3, 2), 1500)])  # V > one block
def test_kernel_walk_equals_the_reference(rule, widths, vocab):
    generator = torch.Generator().manual_seed(vocab)
    batch, max_children = 16, max(widths)
    layout, parents, valid, tokens, p, q = _trees(widths, batch, vocab, generator)
    draft_probs = q if rule == "rrs" else None
    # Each child drawn from its parent's q (rrs) or p (deterministic): some are accepted, some walks go deep.
    source = (q if rule == "rrs" else p).cpu()
    parent_dist = source.gather(1, parents.clamp(min=0).cpu()[..., None].expand(-1, -1, vocab))
    tokens = torch.multinomial(parent_dist.reshape(-1, vocab), 1, generator=generator)
    tokens = tokens.reshape(batch, layout.num_nodes).to(DEVICE)
    children = child_table(parents, valid, max_children)
    draws = torch.rand(batch, layout.depth * max_children + 1, dtype=torch.float64, generator=generator)
    draws = draws.to(DEVICE)
    out = (
        torch.full((batch, layout.depth + 1), -7, dtype=torch.long, device=DEVICE),
        torch.full((batch,), -7, dtype=torch.long, device=DEVICE),
        torch.full((batch, vocab), float("nan"), dtype=torch.float64, device=DEVICE),
    )
    path, length, residual = sample_walk(tokens, children, p, draws, layout.depth, draft_probs, out=out)
    ref_path, ref_length, ref_residual = sample_walk_naive(
        tokens, children, p, draws, layout.depth, draft_probs
    )
    assert path.data_ptr() == out[0].data_ptr() and not torch.isnan(residual).any()
    assert torch.equal(length, ref_length) and torch.equal(path, ref_path)
    torch.testing.assert_close(residual, ref_residual, rtol=1e-12, atol=1e-15)
    assert ref_length.max() > 1 and ref_length.min() < layout.depth + 1  # both accepting and stopping walks


def test_kernel_walk_edge_cases():
    """A node without children (the walk stops with p), children that q and p agree on exactly (acceptance
    certain: the residual update never runs), a leaf reached (residual = the leaf's p)."""
    vocab = 8
    layout = TreeLayout((2, 1))  # root, two children, one grandchild under the first child
    parents = torch.tensor([[-1, 0, 0, 1]] * 3, device=DEVICE)
    valid = torch.tensor([[True, True, True, True], [True, False, False, False], [True, True, True, True]])
    valid = valid.to(DEVICE)
    tokens = torch.tensor([[0, 3, 4, 5]] * 3, device=DEVICE)
    p = torch.full((3, 4, vocab), 1.0 / vocab, device=DEVICE)
    p[0, 0] = 0.0
    p[0, 0, 3] = 1.0  # row 0: the target is certain of token 3 at the root, then uniform
    children = child_table(parents, valid, 2)
    draws = torch.full((3, 2 * 2 + 1), 0.5, dtype=torch.float64, device=DEVICE)
    for draft_probs in (p.clone(), None):  # q == p: every child accepted where p(x) > 0
        got = sample_walk(tokens, children, p, draws, layout.depth, draft_probs)
        ref = sample_walk_naive(tokens, children, p, draws, layout.depth, draft_probs)
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert got[1][1] == 1  # row 1 has no valid child: it stops at the root


def test_sample_path_through_the_kernel_equals_the_reference(monkeypatch):
    """`sample_path` gives the same (path, length, bonus) whichever walk runs (on CUDA, the kernel)."""
    from longspec.infer import accept

    assert accept._walk_for(torch.device("cuda")) is sample_walk
    assert accept._walk_for(torch.device("cpu")) is sample_walk_naive
    generator = torch.Generator().manual_seed(3)
    layout, parents, valid, tokens, p, q = _trees((4, 4, 4), 8, 64, generator)
    draws = torch.rand(8, layout.depth * 4 + 1, dtype=torch.float64, generator=generator).to(DEVICE)
    args = (tokens, parents, valid, p, draws)
    ref = sample_path(*args, depth=layout.depth, max_children=4, draft_probs=q)
    monkeypatch.setattr(accept, "_walk_for", lambda device: sample_walk)
    got = sample_path(*args, depth=layout.depth, max_children=4, draft_probs=q)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)


COMPILE_FOR_SM90 = """
import inspect, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from longspec.kernels.tree_sampling.triton import _walk_kernel

pointers = {"TOKENS": "*i64", "CHILDREN": "*i64", "P_IN": "*fp32", "Q_IN": "*fp32", "DRAWS": "*fp64",
            "PATH": "*i64", "LENGTH": "*i64", "RESIDUAL": "*fp64", "QW": "*fp64"}
signature = {}
for name in inspect.signature(_walk_kernel.fn).parameters:
    if name in ("DEPTH", "K", "HAS_Q", "BLOCK"):
        signature[name] = "constexpr"
    else:
        signature[name] = pointers.get(name, "i64" if name.startswith("stride") else "i32")
for has_q in (True, False):
    constexprs = {"DEPTH": 5, "K": 16, "HAS_Q": has_q, "BLOCK": 1024}
    try:
        compiled = triton.compile(ASTSource(_walk_kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32))
    except RuntimeError as error:
        if "ptxas" in str(error):
            sys.exit(77)  # this Triton build ships no CUDA assembler
        raise
    assert compiled.asm["cubin"]
"""


def test_the_kernel_compiles_for_an_h100_class_gpu():
    """The interpreter runs the kernel's Python; this compiles it to a CUDA binary (sm_90, both rules) on any
    machine, in a process without the interpreter, so a construct the GPU compiler refuses fails here rather
    than in the first T > 0 round on a GPU."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90], env=env, capture_output=True, text=True)
    if done.returncode == 77:
        pytest.skip("no CUDA assembler in this Triton build")
    assert done.returncode == 0, done.stderr[-3000:]
