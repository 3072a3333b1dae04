"""sftpack.report.layout: the worked example of docs/contract.md section 2, built by each
path's own code, and its text and PNG drawings."""

from __future__ import annotations

from sftpack import PackedBatch
from sftpack.report.layout import (
    demo_figure,
    draw_row,
    draw_row_to_scale,
    render_map,
    save_demo_png,
    save_map_png,
    worked_example,
)
from sftpack.testing import samples_from_lengths


def test_the_worked_example_has_the_contracts_boundaries():
    rows = {r.path: r.batch for r in worked_example()}
    assert list(rows) == ["offline", "loader", "trainer"]
    expected = {  # (cu_seqlens, cu_seqlens_padded, width) as docs/contract.md section 2 lays them
        "offline": ([0, 5, 15], [0, 5, 16], 16),
        "loader": ([0, 5, 15], [0, 8, 36], 36),
        "trainer": ([0, 5, 15], [0, 8, 20], 20),
    }
    for path, (cu, cup, width) in expected.items():
        b = rows[path].validate()
        assert (b.cu_seqlens.tolist(), b.cu_seqlens_padded.tolist(), b.num_tokens) == (cu, cup, width), path
        assert b.input_ids[:5].tolist() == [1, 2, 3, 4, 5]  # A's tokens, first, on every path


def test_draw_row_marks_segments_padding_and_wraps():
    b = PackedBatch.from_samples(samples_from_lengths([3, 2]), pad_multiple=4)  # slots AAA. BB..
    assert draw_row(b) == "A A A . |B B . ."
    assert draw_row(b, width=3) == "A A A\n. |B B\n. ."


def test_render_map_shows_every_path_and_its_boundaries():
    text = render_map()
    for path in ("offline", "loader", "trainer"):
        assert f"\n{path} " in text
    assert "cu_seqlens=[0, 5, 15]  cu_seqlens_padded=[0, 8, 36]" in text  # the loader row
    assert text.count("|B") == 3  # B starts a segment on each of the three rows


def test_save_map_png_writes_a_png(tmp_path):
    path = save_map_png(str(tmp_path / "map.png"))
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def _image_row():
    """docs/multimodal.md's row: A (8 slots, a 4-slot image run at 2) and B (7, a 2-slot run at 2), pad 4."""
    import numpy as np

    from sftpack import Sample
    from sftpack.handoff.payload import PatchMedia
    from sftpack.multimodal.families.qwen2_vl import mrope_positions

    def sample(ids, grid):
        ids = np.array(ids)
        n = int(np.prod(grid))
        runs, grids = np.array([(int(np.argmax(ids == 151655)), n // 4)]), np.array([grid])
        media = PatchMedia(
            pixel_values=np.zeros((n, 1176), np.float32),
            slots=runs,
            sequence=[0],
            token_id=151655,
            grid_thw=grids,
            merge_size=2,
            positions=mrope_positions(len(ids), runs, grids, 2),
        )
        return Sample(ids, ids > 200000, media=media)

    a = sample([1, 151652] + [151655] * 4 + [151653, 5], (1, 4, 4))
    b = sample([1, 151652] + [151655] * 2 + [151653, 6, 7], (1, 2, 4))
    return PackedBatch.from_samples([a, b], pad_multiple=4, pad_id=151643).validate()


def test_draw_row_to_scale_marks_image_runs_and_keeps_proportions():
    row = _image_row()  # slots: A A # # # # A A | B B # # B B B .
    assert draw_row_to_scale(row, width=16) == "AA####AABB##BBB."
    assert draw_row_to_scale(row, width=8) == "A##AB#BB"  # two slots a character, the first slot's on a tie
    assert draw_row_to_scale(row, width=100) == draw_row_to_scale(row, width=16)  # never more than one per slot
    b = PackedBatch.from_samples(samples_from_lengths([3, 2]), pad_multiple=4)  # a text row: no '#'
    assert draw_row_to_scale(b, width=8) == "AAA.BB.."


def test_save_demo_png_draws_rows_with_images(tmp_path):
    row = _image_row()
    bars = {"fill": {"vqa": 0.9}, "tokens_per_s": {"vqa packed": 10.0, "vqa padded": 8.0}}
    path = save_demo_png(tmp_path, {}, [row], bars)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _demo_summary():
    from sftpack.report.demo import PathSummary
    from sftpack.trainer import pack_step, padded_batch

    samples = samples_from_lengths([30, 200, 40, 90, 10])
    ids, lens, mask = padded_batch(samples, pad_id=0)
    summary = {
        "offline": PathSummary("offline", fill=0.97, losses=[3.0, 2.5, 2.0], tokens_per_s=900.0),
        "loader": PathSummary("loader", fill=0.95, losses=[3.0, 2.6, 2.2], tokens_per_s=850.0),
        "trainer": PathSummary("trainer", fill=1.0, losses=[3.0, 2.7, 2.1], tokens_per_s=800.0),
        "none": PathSummary("none", fill=0.4, losses=[3.0, 2.7, 2.1], tokens_per_s=400.0),
    }
    summary["offline"].first_rows = [PackedBatch.from_samples(samples[:3], max_seq_len=300)]
    summary["loader"].first_rows = [PackedBatch.from_samples(samples[3:], max_seq_len=300)]
    summary["trainer"].first_rows = [pack_step(ids, lens, mask, pad_id=0)]  # 370 real slots: wider than 300
    summary["none"].first_rows = [PackedBatch.from_samples([x], max_seq_len=200) for x in samples[:2]]
    return summary


def test_demo_figure_titles_inside_curves_apart_row_widths_labelled():
    import matplotlib

    matplotlib.use("Agg")
    bars = {"fill": {"vqa, tokens only": 0.9, "vqa, + patch budget": 0.5}, "tokens_per_s": {"vqa packed": 9.0}}
    fig = demo_figure(_demo_summary(), [_image_row()], bars)
    fig.canvas.draw()
    box = fig.bbox
    texts = [t for ax in fig.axes for t in ax.texts]  # the notes written on the panels
    titles = [t for ax in fig.axes for t in (ax.title,) if t.get_text()] + [fig._suptitle]
    for t in titles + texts:  # no title or note cut at the figure's edges
        e = t.get_window_extent()
        assert box.x0 <= e.x0 and e.x1 <= box.x1 and box.y0 <= e.y0 and e.y1 <= box.y1, t.get_text()
    words = [t.get_text() for t in texts]
    assert "trainer rows: as wide as each batch\nneeds (up to 370 slots here)" in words
    assert "offline rows: 300 slots\n(max_seq_len)" in words
    # the trainer curve equals the padded one (same conversations) and must stay visible over it
    loss = next(ax for ax in fig.axes if ax.get_title().startswith("training loss"))
    lines = {ln.get_label(): ln for ln in loss.get_lines()}
    a, b = lines["trainer"], lines["none"]
    assert list(a.get_ydata()) == list(b.get_ydata())
    assert (a.get_linestyle(), a.get_marker()) != (b.get_linestyle(), b.get_marker())
    assert a.get_zorder() > b.get_zorder() and a.get_markerfacecolor() == "none"  # drawn on top, see-through
