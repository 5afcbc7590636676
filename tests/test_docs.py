"""The documentation cannot go stale: generated tables match their result files and `GRPOConfig`, links resolve, the
README stays short, and no measured figure hides in a docstring or help text of the package."""

import dataclasses
import re
from pathlib import Path

import pytest

from benchmarks import tables
from grpo_hf import GRPOConfig
from grpo_hf.config import grpo_field_names


ROOT = Path(__file__).resolve().parents[1]


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_generated_table_is_up_to_date(capsys):
    assert tables.main(["--check"]) == 0, capsys.readouterr().out


def test_every_renderer_is_used_and_every_block_is_known():
    used = {m.group("name") for path in DOCS for m in tables.BLOCK.finditer(path.read_text())}
    assert used == set(tables.RENDERERS)


def _table_rows(block: str) -> dict[str, tuple[str, str]]:
    text = (ROOT / "docs" / "settings.md").read_text()
    body = next(m.group("body") for m in tables.BLOCK.finditer(text) if m.group("name") == block)
    return {m.group(1): (m.group(2), m.group(3)) for m in re.finditer(r"^\| `(\w+)` \| (.*?) \| (.*) \|$", body, re.M)}


@pytest.mark.parametrize("block", ["settings", "recipe-settings"])
def test_the_settings_tables_are_grpo_config_and_recipe_config(block):
    from grpo_hf.harness.arguments import RecipeConfig, recipe_field_names

    rows = _table_rows(block)
    dtype, names = (GRPOConfig, grpo_field_names()) if block == "settings" else (RecipeConfig, recipe_field_names())
    fields = {f.name: f for f in dataclasses.fields(dtype)}
    assert list(rows) == names  # every field the class adds, in order, and nothing else
    for name, (default, help_text) in rows.items():
        assert default == tables._fmt_default(fields[name].default), name
        assert help_text.startswith(fields[name].metadata["help"].replace("%%", "%").replace("|", "\\|")), name


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(path):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
        if "://" in target:
            continue
        assert (path.parent / target).exists(), f"{path.name} links to a missing {target}"


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


# A copied measurement: a ratio (3.7x, 1.005×), a time per unit (17 ms per M), a percentage of a result (12% worse, as
# a docstring writes it, or 12%% worse, as a help text must).
MEASURED_FIGURE = re.compile(
    r"\b\d+(\.\d+)?\s?[x×](?![\w\d])|\d\s?ms (per|/)"
    r"|\b\d+(\.\d+)?\s?%{1,2} (worse|better|fewer|less|more|faster|slower|lower|higher|smaller|larger)"
)


@pytest.mark.parametrize(
    "text", ["3.7x faster", "1.005× the bytes", "17 ms per M", "12% worse", "0.5%% better", "4 % less"]
)
def test_the_figure_pattern_catches_copied_measurements(text):
    assert MEASURED_FIGURE.search(text)


@pytest.mark.parametrize("text", ["the top 15% of entries", "x86", "ramp 1, 3, 7", "5% of the files held out"])
def test_the_figure_pattern_lets_settings_through(text):
    assert not MEASURED_FIGURE.search(text)


def test_no_measured_figure_in_the_package_source():
    found = []
    for path in sorted((ROOT / "grpo_hf").rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if MEASURED_FIGURE.search(line) and 'f"' not in line:
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)
