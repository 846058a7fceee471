"""`towers explain --png` stays readable at 1 to 8 towers and every placement:
no arrow runs through a box it does not start or end at, and every line of
text sits inside its own box."""

import numpy as np
import pytest

from tests.explain.test_explain import CPU, make_engine
from tests.models import regression_batch
from towers.explain.diagram import figure, layout

CASES = [(1, "central"), (2, "central"), (4, "balanced"), (8, "balanced"),
         (4, "replicated")]  # fmt: skip


def explained(num_towers, placement):
    engine = make_engine(CPU[:num_towers], placement=placement)
    return engine.explain(*regression_batch(np.random.default_rng(0), 13))


@pytest.mark.parametrize("num_towers, placement", CASES)
def test_no_arrow_runs_through_a_box_it_does_not_join(num_towers, placement):
    placed = layout(explained(num_towers, placement))

    assert len(placed.arrows) >= 2 * (num_towers - 1)  # batch and gradients
    for arrow in placed.arrows:
        ends = (placed.boxes[arrow.source], placed.boxes[arrow.target])
        assert arrow.points[0][1] == ends[0].bottom  # leaves its source's bottom
        assert arrow.points[-1][1] in (ends[1].top, ends[1].bottom)
        others = [b for b in placed.boxes.values() if b not in ends]
        for (x0, y0), (x1, y1) in zip(arrow.points, arrow.points[1:]):
            for f in np.linspace(0, 1, 60):
                point = (x0 + f * (x1 - x0), y0 + f * (y1 - y0))
                crossed = [(b.row, b.device) for b in others if b.holds(*point)]
                assert not crossed, (arrow.kind, arrow.source, arrow.target, crossed)


@pytest.mark.parametrize("num_towers, placement", CASES)
def test_every_line_of_text_sits_inside_its_box(num_towers, placement):
    import matplotlib.pyplot as plt

    e = explained(num_towers, placement)
    fig, placed, drawn = figure(e)
    try:
        renderer = fig.canvas.get_renderer()
        extents = {
            key: patch.get_window_extent(renderer) for key, (patch, _) in drawn.items()
        }
        for key, (_, texts) in drawn.items():
            box = extents[key]
            for text in texts:
                inside = text.get_window_extent(renderer)
                assert box.x0 <= inside.x0 and inside.x1 <= box.x1, (
                    key,
                    text.get_text(),
                )
                assert box.y0 <= inside.y0 and inside.y1 <= box.y1, (
                    key,
                    text.get_text(),
                )
        # What came in is said: each tower past the first gets its batch.
        said = {key: [t.get_text() for t in texts] for key, (_, texts) in drawn.items()}
        for device in e.devices[1:]:
            assert any(s.startswith("<- batch") for s in said[("forward", device)])
    finally:
        plt.close(fig)
