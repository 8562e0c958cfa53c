"""docs/configuration.md is generated from SparseSettings and must stay in step with it."""

from vllm_sparse_backend.settings import SETTINGS, SparseSettings
from vllm_sparse_tools import config_docs


def test_configuration_page_matches_the_settings_model():
    assert config_docs.main(["--check"]) == 0, (
        "docs/configuration.md is out of date: run python -m vllm_sparse_tools.config_docs")


def test_page_lists_every_setting_with_its_default():
    page = config_docs.render()
    for name, setting in SETTINGS.items():
        row = next(line for line in page.splitlines() if line.startswith(f"| `VLLM_SPARSE_{name.upper()}` "))
        assert f"(`{setting.key}`)" in row and config_docs.describe_default(setting.field.default) in row, row
    # a grouped setting is listed by its variable and its nested JSON key
    assert "| `VLLM_SPARSE_METRICS_PORT` (`observability.metrics_port`) |" in page


def test_check_fails_when_a_description_changes(tmp_path, monkeypatch):
    page = tmp_path / "configuration.md"
    assert config_docs.main(["--path", str(page)]) == 0
    assert config_docs.main(["--check", "--path", str(page)]) == 0
    monkeypatch.setattr(SETTINGS["gamma"].field, "description", "Something else.")
    assert config_docs.main(["--check", "--path", str(page)]) == 1


def test_types_and_constraints_are_spelled_for_users():
    fields = SparseSettings.model_fields
    assert config_docs.describe_type(SETTINGS["vertical_share"].field) == "number > 0.0, <= 1.0, or none"
    assert config_docs.describe_type(fields["default_pattern"]).startswith("`dense`, `a_shape`")
    assert config_docs.describe_type(SETTINGS["enabled"].field) == "`true`, `false`"
    assert config_docs.describe_default(fields["default_pattern"].default) == "`vertical_slash`"
