"""The model-family registry finds each family by its folder under
pipeline/models/: a new family is a new package, with no import list to edit."""

from __future__ import annotations

import sys

import pytest

import pipeline.models as models
from pipeline.models import registry
from pipeline.models.errors import UnsupportedModelError

FAMILY_PACKAGE = '''
from pipeline.models.registry import ModelFamily, register


class Zz(ModelFamily):
    name = "zz_test"
    model_types = ("zz-test",)
    architectures = ("ZzForTesting",)

    def parse_config(self, raw):
        return raw

    def build(self, config, dtype):
        raise NotImplementedError

    def spec(self, config):
        raise NotImplementedError

    def canonical_name(self, checkpoint_name, config):
        return checkpoint_name


register(Zz())
'''


def test_the_builtin_family_is_found():
    assert "qwen2_5_vl" in [f.name for f in registry.families()]
    assert registry.family_for({"model_type": "qwen2_5_vl"}).name == "qwen2_5_vl"


@pytest.fixture
def extra_family_folder(tmp_path, monkeypatch):
    """A family package in a folder added to pipeline.models' search path,
    as if it were pipeline/models/zz_test_family/."""
    (tmp_path / "zz_test_family").mkdir()
    (tmp_path / "zz_test_family" / "__init__.py").write_text(FAMILY_PACKAGE)
    monkeypatch.setattr(models, "__path__", [*models.__path__, str(tmp_path)])
    before = list(registry._FAMILIES)
    registry._import_builtin_families.cache_clear()
    yield
    registry._FAMILIES[:] = before
    sys.modules.pop("pipeline.models.zz_test_family", None)
    registry._import_builtin_families.cache_clear()


def test_a_new_family_folder_is_found_without_editing_the_registry(extra_family_folder):
    assert registry.family_for({"model_type": "zz-test"}).name == "zz_test"
    assert registry.family_for({"architectures": ["ZzForTesting"]}).name == "zz_test"


def test_an_unknown_model_type_names_the_supported_ones():
    with pytest.raises(UnsupportedModelError, match="supported model types: .*qwen2_5_vl"):
        registry.family_for({"model_type": "nope", "architectures": ["Nope"]})
