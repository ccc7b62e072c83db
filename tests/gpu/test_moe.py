"""The mixture-of-experts layer (``layers.moe``) on a real GPU, at Qwen3-30B-A3B's
shapes (128 experts of 768, 8 routed a token, hidden 2048): the router against torch's
softmax and top-k, the grouping's invariants, the layer against transformers' own
loop over the experts, and a row's bits alone and in batches of 1 to 2,048. Each test
prints what it measured."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dpu_frontend.model.layers.linear import linear
from dpu_frontend.model.layers.moe import (
    MOE_BLOCK_M,
    MOE_LOTS_PAIRS,
    _group_spread,
    _group_with_torch,
    group_by_expert,
    moe_mlp,
    route,
)

pytestmark = pytest.mark.gpu

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
#: Row counts from one token to a prompt chunk's 2,048, each tile tier's among them
#: (``moe_tiles``: 16-row tiles below 8 pairs an expert, 64 below MOE_LOTS_PAIRS, 128).
ROWS = (1, 2, 7, 16, 17, 40, 64, 65, 100, 128, 129, 200, 256, 257, 384, 512, 1500,
        MOE_LOTS_PAIRS * EXPERTS // TOP_K)


def weights(dtype: torch.dtype, seed: int, experts: int = EXPERTS, hidden: int = HIDDEN,
            inter: int = INTER) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A router [experts, hidden] and the experts' gate_up and down, HF's init scale."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device="cuda") * 0.02).to(dtype)

    return draw(experts, hidden), draw(experts, 2 * inter, hidden), draw(experts, hidden, inter)


def transformers_moe(x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor,
                     down: torch.Tensor, top_k: int) -> torch.Tensor:
    """transformers' ``Qwen3MoeSparseMoeBlock`` from the router's ``logits``: softmax and
    top-k in float32, the weights in the model dtype, its loop over the experts hit
    with ``index_add_`` in the model dtype."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top, ids = torch.topk(probs, top_k, dim=-1)
    top = (top / top.sum(dim=-1, keepdim=True)).to(logits.dtype)
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        token, slot = torch.where(ids == e)
        if token.numel() == 0:
            continue
        gate, up = F.linear(x[token], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * top[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def test_the_router_is_torchs_softmax_and_top_k() -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn((300, EXPERTS), generator=gen, device="cuda")
    for norm in (True, False):
        ids, w = route(logits, TOP_K, norm)
        probs = torch.softmax(logits, dim=-1)
        top, expected = torch.topk(probs, TOP_K, dim=-1)
        if norm:
            top = top / top.sum(dim=-1, keepdim=True)
        assert torch.equal(ids.long(), expected)
        assert float((w - top).abs().max()) < 1e-6
    # bf16 logits with ties (a rounded router's): the lowest id among equals, as a
    # stable sort would give; weights in bf16, as transformers casts them.
    tied = logits.to(torch.bfloat16).round()
    ids, w = route(tied, TOP_K, True)
    probs = torch.softmax(tied.float(), dim=-1)
    order = torch.sort(-probs, dim=-1, stable=True).indices[:, :TOP_K]
    assert torch.equal(ids.long(), order) and w.dtype == torch.bfloat16
    print(f"router: {logits.shape[0]} tokens x {EXPERTS} experts, top {TOP_K}: torch's ids, "
          "weights within 1e-6; with ties, the lowest id first")


def test_pairs_are_grouped_by_expert_in_whole_blocks() -> None:
    gen = torch.Generator(device="cuda").manual_seed(2)
    for tokens in (1, 5, 64, 333):
        ids = torch.stack([torch.randperm(EXPERTS, generator=gen, device="cuda")[:TOP_K]
                           for _ in range(tokens)]).int()
        pairs, block_expert = group_by_expert(ids, EXPERTS)
        n = tokens * TOP_K
        real = pairs[pairs < n].long()
        assert torch.equal(torch.sort(real).values, torch.arange(n, device="cuda"))
        blocks = pairs.view(-1, MOE_BLOCK_M)
        for b in range(blocks.shape[0]):
            members = blocks[b][blocks[b] < n].long()
            expert = int(block_expert[b])
            if expert == EXPERTS:
                assert members.numel() == 0
                continue
            assert members.numel() > 0
            assert bool((ids.view(-1)[members] == expert).all())
            # Within an expert, pairs in their order (a stable sort).
            assert bool((members[1:] > members[:-1]).all())
    print("grouping: every pair once, each block one expert's, in order, padding after")


def test_the_grouping_is_torchs_sort() -> None:
    """The grouping spread over programs (``_group_spread``) gives the tensors of torch's
    sort and scans bit for bit, from no token to a mixed step's 2,048: spread and skewed
    routing, 60 experts (not a power of 2), the GEMM's 16-, 64- and 128-row blocks."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    cases = 0
    for experts, k in ((EXPERTS, TOP_K), (60, 4)):
        for tokens in (0, 1, 3, 16, 33, 256, 2048):
            spread = torch.zeros((tokens, k), dtype=torch.int32, device="cuda")
            for t in range(tokens):
                spread[t] = torch.randperm(experts, generator=gen, device="cuda")[:k]
            skewed = torch.arange(k, device="cuda", dtype=torch.int32).repeat(tokens, 1)
            for ids, block_m in itertools.product((spread, skewed), (MOE_BLOCK_M, 64, 128)):
                n = ids.numel()
                blocks = -(-n // block_m) + min(experts, n)
                pairs, block_expert = _group_spread(ids, experts, block_m, blocks)
                want = _group_with_torch(ids, experts, block_m, blocks)
                assert torch.equal(pairs, want[0]) and torch.equal(block_expert, want[1]), (
                    experts, k, tokens, block_m)
                cases += 1
    print(f"the spread grouping = torch's sort and scans in {cases} cases, up to 16,384 "
          "pairs")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_the_layer_is_transformers_loop(dtype: torch.dtype) -> None:
    """The experts' sum against transformers' loop on the same router logits (in bf16 a
    logit an ulp apart may pick another expert: the router is tested above); the
    residual is added to that sum rounded, bit for bit."""
    router, gate_up, down = weights(dtype, 3)
    gen = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn((200, HIDDEN), generator=gen, device="cuda").to(dtype)
    residual = torch.randn((200, HIDDEN), generator=gen, device="cuda").to(dtype)
    logits = F.linear(x, router) if dtype == torch.float32 else linear(x, router)
    ours = moe_mlp(x, logits, gate_up, down, torch.zeros_like(x), TOP_K, True)
    theirs = transformers_moe(x, logits, gate_up, down, TOP_K)
    err = float((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max())
    with_residual = moe_mlp(x, logits, gate_up, down, residual, TOP_K, True)
    assert torch.equal(with_residual, (residual.float() + ours.float()).to(dtype))
    print(f"MoE layer {dtype}: max |difference| against transformers' loop {err:.2e} of the "
          "largest output")
    assert err < (1e-5 if dtype == torch.float32 else 2e-2)


def test_a_row_has_its_bits_alone_in_any_batch() -> None:
    """Rows 0..m-1 of a batch of m are each the row computed alone, for 16 row counts,
    and the same rows in reverse order are the same bits."""
    router, gate_up, down = weights(torch.bfloat16, 5)
    gen = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn((max(ROWS), HIDDEN), generator=gen, device="cuda").to(torch.bfloat16)
    residual = torch.randn((max(ROWS), HIDDEN), generator=gen, device="cuda").to(torch.bfloat16)

    def call(rows: Any) -> torch.Tensor:
        return moe_mlp(x[rows], linear(x[rows], router), gate_up, down, residual[rows], TOP_K,
                       True)

    alone = torch.cat([call(slice(i, i + 1)) for i in range(max(ROWS))])
    for m in ROWS:
        assert torch.equal(call(slice(0, m)), alone[:m]), f"{m} rows"
    backwards = torch.arange(max(ROWS) - 1, -1, -1, device="cuda")
    assert torch.equal(call(backwards), alone[backwards])
    print(f"MoE layer bf16 ({EXPERTS} experts, top {TOP_K}): every row its bits alone at "
          f"{len(ROWS)} row counts from 1 to {max(ROWS)}, and in reverse order")
