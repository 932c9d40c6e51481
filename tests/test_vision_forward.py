"""The vision forward's execution helpers: segment attention (windows and
frames) against one SDPA call per segment; where vision graphs apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline.models.segments import plan_segments, segment_attention


def per_segment(qkv: torch.Tensor, seqlens: list[int], scale: float) -> torch.Tensor:
    out, start = [], 0
    for n in seqlens:
        q, k, v = (qkv[start:start + n, i].transpose(0, 1)[None] for i in range(3))
        if n:
            out.append(F.scaled_dot_product_attention(q, k, v, scale=scale)[0].transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("seqlens", [[16, 16, 16], [16, 12, 0, 16, 9, 12, 16], [7], [0, 5, 0]])
def test_segment_attention_equals_one_call_per_segment(seqlens):
    qkv = torch.randn(sum(seqlens), 3, 4, 8, generator=torch.Generator().manual_seed(len(seqlens)))
    plan = plan_segments(seqlens, qkv.device)
    torch.testing.assert_close(segment_attention(qkv, plan, 0.3), per_segment(qkv, seqlens, 0.3))
    # One length (empty segments hold no rows) needs no gather; more gather.
    assert all(g.index is None for g in plan.groups) == (len(set(seqlens) - {0}) == 1)


def test_plan_groups_by_length_and_rejects_other_sizes():
    plan = plan_segments([4, 2, 4, 0, 2], torch.device("cpu"))
    assert [(g.length, g.count, g.index.tolist()) for g in plan.groups] == [
        (4, 2, [0, 1, 2, 3, 6, 7, 8, 9]), (2, 2, [4, 5, 10, 11])]
    with pytest.raises(ValueError, match="12 tokens"):
        segment_attention(torch.zeros(13, 3, 1, 4), plan, 1.0)


def test_segments_read_through_rows_slice_where_consecutive_and_gather_elsewhere():
    seqlens = [4, 2, 4, 3]
    # The 4s side by side from row 4, the 2 at rows 0-1, the 3 scattered.
    perm = torch.tensor([4, 5, 6, 7, 0, 1, 8, 9, 10, 11, 2, 3, 12])
    plan = plan_segments(seqlens, torch.device("cpu"), perm)
    assert [(g.length, g.index is None, g.start) for g in plan.groups] == [(4, True, 4), (2, True, 0), (3, False, 0)]
    assert plan.groups[2].index.tolist() == [2, 3, 12]
    qkv = torch.randn(13, 3, 2, 8, generator=torch.Generator().manual_seed(3))
    got = segment_attention(qkv, plan, 0.5)
    want = torch.empty_like(got)
    want[perm] = per_segment(qkv[perm], seqlens, 0.5)   # the sequence's token i is row perm[i]
    torch.testing.assert_close(got, want)


def test_all_slices_come_back_in_row_order():
    seqlens = [3, 3, 5, 5, 2]
    plan = plan_segments(seqlens, torch.device("cpu"))
    assert all(g.index is None for g in plan.groups) and len(plan.groups) == 3
    qkv = torch.randn(18, 3, 2, 8, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(segment_attention(qkv, plan, 0.5), per_segment(qkv, seqlens, 0.5))


def test_qwen2_5_vl_windows_by_size_are_slices_and_frames_read_their_own_rows():
    from pipeline.models.qwen2_5_vl.vision_layout import batch_layout, grid_layout

    grids = [(1, 46, 46), (1, 20, 28), (1, 46, 46)]   # 640x640: windows of 64, 48 and 36 patches
    layout = batch_layout(grids, 2, 4, torch.device("cpu"))
    assert layout.window_seqlens == sorted(layout.window_seqlens, reverse=True)
    windows = plan_segments(layout.window_seqlens, torch.device("cpu"))
    assert len(windows.groups) > 1 and all(g.index is None for g in windows.groups)
    # Read through frame_rows, the rows are each image's units in its own window order.
    offsets = torch.tensor([0, 529, 669])
    images_order = torch.cat([grid_layout(g, 2, 4).window_index + o for g, o in zip(grids, offsets)])
    assert torch.equal(layout.window_index[layout.frame_rows[::4] // 4], images_order)
    assert torch.equal(layout.window_index[layout.reverse_index], torch.arange(layout.window_index.numel()))


def test_vision_graphs_only_on_cuda(caplog):
    """Off the GPU the encoder keeps its eager tower (with a warning) rather
    than failing to start; VisionGraphs itself refuses a CPU device."""
    from pipeline.models.vision_graphs import VisionGraphs, vision_forward

    tower = torch.nn.Identity()
    assert vision_forward(tower, torch.device("cpu"), 0) is tower
    with caplog.at_level("WARNING"):
        assert vision_forward(tower, torch.device("cpu"), 4) is tower
    assert "eagerly" in caplog.text
    with pytest.raises(ValueError, match="CUDA"):
        VisionGraphs(tower, torch.device("cpu"))


def test_batches_cut_into_power_of_two_pieces_of_one_grid():
    from pipeline.models.vision_graphs import plan_pieces

    a, b = (1, 46, 46), (1, 20, 30)
    grids = [a] * 13 + [b, a, b]
    pieces = plan_pieces(grids, max_images=16)
    assert [(g, len(i)) for g, i in pieces] == [(a, 8), (a, 4), (a, 2), (b, 2)]
    assert sorted(i for _, idx in pieces for i in idx) == list(range(len(grids)))   # each image once
    assert all(grids[i] == g for g, idx in pieces for i in idx)
    assert [len(i) for _, i in plan_pieces([a] * 40, max_images=12)] == [8, 8, 8, 8, 8]
    with pytest.raises(ValueError):
        plan_pieces([a], max_images=0)


def test_a_batch_run_in_pieces_equals_one_forward(tiny_dir):
    """Images of two sizes, interleaved: the pieces that have a "graph"
    (here: the 2-image pieces, run eagerly as a stand-in) run one by one,
    the rest together in one packed forward; each image's embedding equals
    the whole batch's, in the batch's order."""
    from conftest import random_image
    from pipeline.models.loader import load_model
    from pipeline.models.vision_graphs import forward_in_pieces
    from pipeline.processing.image import preprocess_images
    from pipeline.processing.processor import Processor

    loaded = load_model(tiny_dir)
    config = Processor.from_checkpoint(tiny_dir, loaded.config.image_token_id).image_config
    images = [random_image(*size, seed=i) for i, size in enumerate([(64, 64), (56, 84)] * 2 + [(64, 64)] * 2)]
    pixels, grid = preprocess_images(images, config)
    grids = [tuple(g) for g in grid.tolist()]
    tower = loaded.model.visual
    replayed, eager_calls = [], []

    def replay(shape, piece_pixels):
        replayed.append(shape)
        return tower(piece_pixels, [shape[0]] * shape[1]) if shape[1] == 2 else None

    def eager(rest_pixels, rest_grids):
        eager_calls.append(rest_grids)
        return tower(rest_pixels, rest_grids)

    with torch.no_grad():
        whole = tower(pixels, grids)
        pieces = forward_in_pieces(pixels, grids, 4, replay, eager)
    # Four 64x64 images make one 4-image piece (no graph: eager), the two
    # 56x84 ones a 2-image piece (replayed).
    assert sorted(n for _, n in replayed) == [2, 4]
    assert eager_calls == [[grids[i] for i in (0, 2, 4, 5)]]   # one packed forward, in batch order
    for got, want in zip(pieces, whole, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_vision_warmup_sizes_parse_and_need_graphs():
    import argparse

    from pipeline.arg_parser import image_sizes as parse_image_sizes
    from pipeline.models.vision_flags import add_vision_graph_flags, check_vision_graph_flags

    assert parse_image_sizes("640x480, 1280x720") == [(640, 480), (1280, 720)]
    for bad in ("640", "640x0", "ax3", "640x480x2"):
        with pytest.raises(argparse.ArgumentTypeError, match="WIDTHxHEIGHT"):
            parse_image_sizes(bad)
    parser = argparse.ArgumentParser()
    add_vision_graph_flags(parser)
    check_vision_graph_flags(parser, parser.parse_args(["--vision-graphs", "8", "--vision-warmup", "640x640"]))
    with pytest.raises(SystemExit):   # a warm-up without graphs is a mistake, said at start-up
        check_vision_graph_flags(parser, parser.parse_args(["--vision-warmup", "640x640"]))
