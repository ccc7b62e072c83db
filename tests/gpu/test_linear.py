"""The linear layer's batch invariance on a real GPU: every tile of the table, at every
row count, gives a row the bits it has alone, and the fused epilogues (SwiGLU, the
residual add) give the bits of the unfused layers (docs/gpu.md, "Linear tiles")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import triton

from benchmarks.linear_tiles import Shape, shapes
from dpu_frontend.model.config import ModelConfig
from dpu_frontend.model.layers import linear
from dpu_frontend.model.layers.activation import silu_mul

pytestmark = pytest.mark.gpu

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"

#: Row counts at both ends of every bucket, and a few between.
ROWS = (1, 2, 7, 16, 17, 40, 64, 65, 100, 128, 129, 200, 256, 257, 384, 512)
#: Rows checked alone against their place in each batch: first, middle, last.
PROBES = (0, 0.5, 1.0)


def model_shapes() -> list[Shape]:
    """Each linear of Qwen3-0.6B and of Qwen3-8B, as the model calls it (the LM heads to
    float32, the 8B's with TMA tiles past 64 rows), and Qwen3-30B-A3B's router."""
    moe = ModelConfig.load(CONFIGS / "qwen3-30b-a3b.json")
    return (shapes(ModelConfig.default()) + shapes(ModelConfig.load(CONFIGS / "qwen3-8b.json"))
            + [s for s in shapes(moe) if s.name == "router"])


def call(shape: Shape, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None,
         tile: linear.Tile | None = None) -> torch.Tensor:
    return linear.linear(x, w, shape.out_dtype, gated=shape.gated, residual=residual, tile=tile)


@pytest.mark.parametrize("shape", model_shapes(), ids=lambda s: f"{s.name}-{s.n}x{s.k}")
def test_a_row_has_its_bits_alone_in_every_bucket(shape: Shape) -> None:
    gen = torch.Generator(device="cuda").manual_seed(shape.n * 7 + shape.k)
    w = (torch.randn((shape.n, shape.k), generator=gen, device="cuda") * 0.05).to(torch.bfloat16)
    out_n = shape.n // 2 if shape.gated else shape.n
    x = torch.randn((max(ROWS), shape.k), generator=gen, device="cuda").to(torch.bfloat16)
    residual = (torch.randn((max(ROWS), out_n), generator=gen, device="cuda").to(torch.bfloat16)
                if shape.residual else None)
    alone = torch.cat([call(shape, x[i:i + 1], w, None if residual is None else
                            residual[i:i + 1]) for i in range(max(ROWS))])
    buckets = [linear.linear_tile(shape.n, shape.k, torch.bfloat16, m) for m in ROWS]
    tiles = 0
    for m in ROWS:
        r = None if residual is None else residual[:m]
        tables = call(shape, x[:m], w, r)
        assert torch.equal(tables, alone[:m]), f"{shape.name}: {m} rows, the table's tile"
        # The table's tiles of every other bucket, too: any of them is exact at any M.
        for tile in set(buckets) - {linear.linear_tile(shape.n, shape.k, torch.bfloat16, m)}:
            got = call(shape, x[:m], w, r, tile)
            tiles += 1
            rows = sorted({int(p * (m - 1)) for p in PROBES})
            assert torch.equal(got[rows], alone[rows]), f"{shape.name}: {m} rows, tile {tile}"
    print(f"{shape.name} [{shape.n} x {shape.k}]: {len(ROWS)} row counts, {tiles} tile runs, "
          "every row its bits alone")


#: The table's tile (None), tiles whose splits are spread over programs (a second kernel
#: adds the partial sums and runs the epilogue), and a TMA tile.
EPILOGUE_TILES = (None, linear.BUCKET_TILES[0]._replace(spread=True),
                  linear.BUCKET_TILES[4]._replace(spread=True),
                  linear.Tile(64, 64, 128, 4, 4, tma=True))


@pytest.mark.parametrize("tile", EPILOGUE_TILES, ids=str)
@pytest.mark.parametrize("split", [1, 2, 4])
def test_the_fused_epilogues_are_the_unfused_layers_bit_for_bit(
        split: int, tile: linear.Tile | None) -> None:
    gen = torch.Generator(device="cuda").manual_seed(11)
    for m in (1, 33, 300):
        x = torch.randn((m, 1024), generator=gen, device="cuda").to(torch.bfloat16)
        gate_up = (torch.randn((6144, 1024), generator=gen, device="cuda") * 0.05).to(torch.bfloat16)
        assert torch.equal(linear.linear(x, gate_up, gated=True, split=split, tile=tile),
                           silu_mul(linear.linear(x, gate_up, split=split)))
        down = (torch.randn((1024, 3072), generator=gen, device="cuda") * 0.05).to(torch.bfloat16)
        act = torch.randn((m, 3072), generator=gen, device="cuda").to(torch.bfloat16)
        h = torch.randn((m, 1024), generator=gen, device="cuda").to(torch.bfloat16)
        assert torch.equal(linear.linear(act, down, residual=h, split=split, tile=tile),
                           h + linear.linear(act, down, split=split))


#: TMA tiles of the tables' kinds: narrow and 128 deep, one warpgroup; two warpgroups,
#: 128 x 128, 128 x 256 and 256 x 128.
TMA_TILES = (linear.Tile(64, 64, 128, 4, 4, tma=True), linear.Tile(128, 128, 64, 8, 4, tma=True),
             linear.Tile(128, 256, 64, 8, 3, tma=True), linear.Tile(256, 128, 64, 8, 3, tma=True))
#: Tiles of both kernels, with the splits in one program and spread over programs.
SPLIT_TILES = {*linear.BUCKET_TILES, *(t._replace(spread=True) for t in linear.BUCKET_TILES),
               *TMA_TILES[:2]}
#: The TMA tests' condition: torch's GPU, and the engine's own test of it.
HOPPER = torch.cuda.is_available() and linear.has_tma(torch.cuda.current_device())


@pytest.mark.parametrize("split", [2, 4])
def test_a_k_split_is_fixed_by_shape_and_batch_invariant(split: int) -> None:
    """Splits of K change a shape's bits (another order of the sum), the same for every
    row count and tile, whether one program adds the splits or a second kernel does: a
    row alone, and inside 1 to 512 rows, in every bucket."""
    gen = torch.Generator(device="cuda").manual_seed(13)
    w = (torch.randn((4096, 4096), generator=gen, device="cuda") * 0.05).to(torch.bfloat16)
    x = torch.randn((512, 4096), generator=gen, device="cuda").to(torch.bfloat16)
    alone = torch.cat([linear.linear(x[i:i + 1], w, split=split) for i in range(512)])
    tiles = SPLIT_TILES
    for m in ROWS:
        for tile in tiles:
            assert torch.equal(linear.linear(x[:m], w, split=split, tile=tile), alone[:m]), \
                f"{m} rows, tile {tile}, {split} splits"
    unsplit = linear.linear(x[:8], w, split=1)
    assert float((alone[:8].float() - unsplit.float()).abs().max()) < 0.05


@pytest.mark.skipif(not HOPPER, reason="the TMA takes a Hopper GPU or later")
@pytest.mark.parametrize("ws", [False, True], ids=["one-stream", "warp-specialized"])
@pytest.mark.parametrize("gated", [False, True])
def test_tma_tiles_at_ragged_edges_are_the_reference_bit_for_bit(gated: bool, ws: bool) -> None:
    """Output columns that end inside a block (a gated block's gate rows past N read as
    zeros, not as up rows), a K that ends inside a block, and a weight whose rows are
    padded: each TMA tile gives the reference tile's bits, where it fits in shared
    memory, its loop as one stream or warp-specialized (``Tile.ws``)."""
    gen = torch.Generator(device="cuda").manual_seed(15)
    out_n, k = 100, 520
    rows = 2 * out_n if gated else out_n
    padded = (torch.randn((rows, k + 56), generator=gen, device="cuda") * 0.05).to(torch.bfloat16)
    for w in (padded[:, :k], padded[:, :k].contiguous()):
        x = torch.randn((300, k), generator=gen, device="cuda").to(torch.bfloat16)
        assert linear.tma_fits(x, w)
        ran = 0
        for tile in (t._replace(ws=ws) for t in TMA_TILES):
            for m in (1, 65, 300):
                reference = linear.linear(x[:m], w, gated=gated, tile=linear.REFERENCE_TILE)
                try:
                    got = linear.linear(x[:m], w, gated=gated, tile=tile)
                except triton.runtime.OutOfResources:
                    break  # a tile too large for this kernel's shared memory
                assert torch.equal(got, reference), f"{tile}, {m} rows, stride {w.stride(0)}"
                ran += 1
        assert ran >= 2 * 3


@pytest.mark.skipif(not HOPPER, reason="the TMA takes a Hopper GPU or later")
@pytest.mark.parametrize("gated", [False, True])
def test_operands_the_tma_cannot_read_take_the_pointer_kernel_with_the_same_bits(
        gated: bool) -> None:
    """A TMA tile over rows whose base is not 16-byte aligned runs the pointer kernel with
    the same block, and gives the aligned rows' bits."""
    gen = torch.Generator(device="cuda").manual_seed(14)
    w = (torch.randn((2048, 1024), generator=gen, device="cuda") * 0.05).to(torch.bfloat16)
    flat = torch.randn((300 * 1024 + 1,), generator=gen, device="cuda").to(torch.bfloat16)
    shifted = flat[1:].view(300, 1024)
    assert not linear.tma_fits(shifted, w)
    aligned = shifted.clone()
    assert linear.tma_fits(aligned, w)
    for tile in TMA_TILES[:2]:
        assert torch.equal(linear.linear(shifted, w, gated=gated, tile=tile),
                           linear.linear(aligned, w, gated=gated, tile=tile))
        assert torch.equal(linear.linear(aligned, w, gated=gated, tile=tile),
                           linear.linear(aligned, w, gated=gated, tile=linear.REFERENCE_TILE))


def test_a_split_that_cuts_a_k_block_is_refused() -> None:
    x = torch.zeros((3, 384), device="cuda", dtype=torch.bfloat16)
    w = torch.zeros((64, 384), device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="splits"):
        linear.linear(x, w, split=2, tile=linear.Tile(16, 32, 256, 4, 4))


def test_float32_is_float32_matmul() -> None:
    gen = torch.Generator(device="cuda").manual_seed(12)
    x = torch.randn((5, 1024), generator=gen, device="cuda", dtype=torch.float64)
    w = torch.randn((3072, 1024), generator=gen, device="cuda", dtype=torch.float64)
    got = linear.linear(x.float(), w.float()).double()
    assert float((got - x @ w.T).norm() / (x @ w.T).norm()) < 1e-6


def test_a_residual_of_another_shape_is_refused() -> None:
    x = torch.zeros((3, 64), device="cuda", dtype=torch.bfloat16)
    w = torch.zeros((32, 64), device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="residual"):
        linear.linear(x, w, residual=torch.zeros((3, 16), device="cuda", dtype=torch.bfloat16))
