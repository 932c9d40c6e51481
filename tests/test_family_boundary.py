"""A family lives in its folder: outside pipeline/models/, the serving code
knows a model only through its ModelSpec (pipeline/models/spec.py), so a
new family edits no file there. This test keeps it so."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline.models.registry import families
from pipeline.models.spec import ModelSpec, splice_rows

REPO = Path(__file__).resolve().parent.parent
# A family's name, or a read of a family config's own fields / modules.
FORBIDDEN = re.compile(r"(?i)qwen|\.cfg\b|spatial_merge|patch_embed|deepstack|mrope|fullatt_block|window_size")


def serving_sources() -> list[Path]:
    files = [p for p in (REPO / "pipeline").rglob("*.py") if "models" not in p.relative_to(REPO / "pipeline").parts[:1]]
    files += list((REPO / "stages").rglob("*.py")) + [p for p in (REPO / "bin").iterdir() if p.is_file()]
    return sorted(files)


def test_no_serving_file_names_a_family_or_reads_its_config():
    found = [f"{path.relative_to(REPO)}:{number}: {line.strip()}"
             for path in serving_sources()
             for number, line in enumerate(path.read_text().splitlines(), start=1)
             if FORBIDDEN.search(line)]
    assert not found, "family specifics outside pipeline/models/:\n" + "\n".join(found)


def test_the_boundary_check_sees_the_serving_code():
    # A check over no files would pass whatever they held.
    names = {str(p.relative_to(REPO)) for p in serving_sources()}
    assert {"pipeline/engine/runner.py", "stages/generator.py", "bin/epd-launch"} <= names
    assert not any(name.startswith("pipeline/models/") for name in names)


@pytest.mark.parametrize("family", families(), ids=lambda f: f.name)
def test_every_family_answers_the_spec(family, tmp_path):
    assert {"qwen2_5_vl", "qwen3_vl"} <= {f.name for f in families()}
    # A family's spec is what the stages size KV, budgets and widths by.
    from pipeline.models.shape_configs import SHAPES
    raws = [raw for raw in SHAPES.values() if raw["model_type"] in family.model_types]
    assert raws, f"no named shape of {family.name}"
    spec = family.spec(family.parse_config(raws[0]))
    assert isinstance(spec, ModelSpec) and spec.family == family.name
    assert spec.position_axes >= 1 and spec.language.kv_heads >= 1
    assert spec.embedding_width == spec.language.hidden_size * (1 + spec.side_levels)


def spec_with(side_levels: int, hidden: int = 4) -> ModelSpec:
    from pipeline.models.spec import LanguageSpec, VisionSpec
    return ModelSpec("test", LanguageSpec(1, 1, 1, hidden, hidden, 8, 16, 64), VisionSpec(8, 8, 4), 3, 9, (0,),
                     side_levels)


def test_splice_rows_puts_main_rows_in_the_embeddings_and_levels_beside_them():
    import torch

    spec = spec_with(side_levels=2)
    embeds = torch.zeros(6, 4)
    rows = torch.arange(2 * 12, dtype=torch.float32).view(2, 12)   # [main | level 0 | level 1]
    side = splice_rows(spec, embeds, [(3, rows)])
    assert torch.equal(embeds[3:5], rows[:, :4]) and embeds[:3].abs().sum() == 0
    assert side.shape == (6, 2, 4)
    assert torch.equal(side[3:5, 0], rows[:, 4:8]) and torch.equal(side[3:5, 1], rows[:, 8:])
    assert side[:3].abs().sum() == 0 and side[5].abs().sum() == 0


def test_splice_rows_refuses_rows_of_another_width():
    import torch

    with pytest.raises(ValueError, match="12 wide; this model takes 4"):
        splice_rows(spec_with(side_levels=0), torch.zeros(4, 4), [(0, torch.zeros(2, 12))])
    assert splice_rows(spec_with(side_levels=0), torch.zeros(4, 4), [(0, torch.ones(2, 4))]) is None
