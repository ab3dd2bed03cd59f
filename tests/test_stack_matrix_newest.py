"""The drift canary's pure parts (``tools/newest_canary.py``, run as ``tools/stack_matrix.py newest``): which release counts as the newest, the pins
it reads, and the dated rows it writes. No network: the registry's answers are written out here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    """``tools/<name>.py`` as the module ``name`` (the canary imports ``stack_matrix`` by that name; dataclasses look
    their module up in ``sys.modules``)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


stack_matrix = _load("stack_matrix")
newest_canary = _load("newest_canary")


def _pypi(releases: dict[str, list[dict]], requires: list[str] | None = None) -> dict:
    return {"info": {"name": "pkg", "requires_dist": requires}, "releases": releases}


def test_the_newest_final_release_wins_over_pre_releases_yanked_and_empty_ones():
    answer = _pypi({
        "2.9.0": [{"yanked": False}],
        "2.15.0": [{"yanked": False}],
        "2.10.0": [{"yanked": False}],  # sorted as numbers, not text
        "2.16.0rc1": [{"yanked": False}],
        "2.16.0.dev20261201": [{"yanked": False}],
        "2.15.1": [{"yanked": True}],
        "2.15.2": [],  # a release without files: nothing to install
    })
    assert newest_canary.newest_release(answer) == "2.15.0"


def test_post_releases_count_and_trailing_zeros_do_not():
    assert newest_canary.newest_release(_pypi({"0.9.1": [{}], "0.9.1.post1": [{}]})) == "0.9.1.post1"
    assert newest_canary.release_key("2.15") == newest_canary.release_key("2.15.0")
    assert newest_canary.release_key("2.15.0+cpu") is None


def test_no_final_release_is_an_error():
    with pytest.raises(ValueError, match="no final release"):
        newest_canary.newest_release(_pypi({"1.0.0a1": [{}]}))


def test_pip_index_versions_output():
    text = ("WARNING: Location 'file:///opt/pypi/simple/torch/' is ignored\n"
            "torch (2.15.0)\nAvailable versions: 2.15.0, 2.14.1, 2.14.0\n")
    assert newest_canary.parse_pip_index_versions(text) == "2.15.0"
    with pytest.raises(ValueError):
        newest_canary.parse_pip_index_versions("ERROR: No matching distribution found for torchh\n")


def test_base_requirements_leave_out_extras_and_other_packages():
    verl = _pypi({}, ["accelerate", "transformers!=5.6.0,<5.11,>=5.5.3", "ray[default]>=2.41.0",
                      'torch==2.11.0; extra == "vllm"', 'transformers==5.9.0; extra == "cpu"'])
    assert newest_canary.base_requirements(verl) == ["transformers!=5.6.0,<5.11,>=5.5.3"]
    assert newest_canary.base_requirements(_pypi({}, None)) == []


@pytest.mark.parametrize(("spec", "admitted"), [
    ("transformers!=5.6.0,<5.11,>=5.5.3", False),
    ("transformers>=5.5.3", True),
    ("transformers<6", True),
    ("transformers==5.25.*", True),
    ("transformers!=5.25.*", False),
    ("transformers~=5.20", True),
    ("torch==2.11.0", False),
    ("torch<=2.15", True),
    ("torch", True),
])
def test_admits(spec, admitted):
    assert newest_canary._admits(spec, {"torch": "2.15.0", "transformers": "5.25.0"}) is admitted


VERSIONS = {"torch": "2.15.0", "transformers": "5.25.0", "flash-linear-attention": "0.6.0", "fla-core": "0.6.0",
            "verl": "0.9.1"}


def test_rows_say_ok_or_what_broke():
    assert newest_canary.render_canary_row("2026-12-05", VERSIONS, []) == (
        "- newest as of 2026-12-05: torch 2.15.0, transformers 5.25.0, FLA 0.6.0, verl 0.9.1: ok")
    row = newest_canary.render_canary_row("2026-12-05", dict(VERSIONS, **{"fla-core": "0.6.1"}),
                                         ["check qwen3.5-0.8b exit 1 (verdict: FAIL)"],
                                         ["verl 0.9.1 requires transformers<5.11"])
    assert row == ("- newest as of 2026-12-05: torch 2.15.0, transformers 5.25.0, FLA 0.6.0 (fla-core 0.6.1), "
                   "verl 0.9.1: broke: check qwen3.5-0.8b exit 1 (verdict: FAIL) (verl 0.9.1 requires transformers<5.11)")


def _page(*rows: str) -> str:
    return "\n".join(["# Supported stacks", "", newest_canary.CANARY_BEGIN, *rows, newest_canary.CANARY_END, "", "after"])


def test_a_row_goes_first_and_replaces_the_same_dates_row_only():
    old = newest_canary.render_canary_row("2026-11-28", VERSIONS, [])
    same_day = newest_canary.render_canary_row("2026-12-05", VERSIONS, ["install failed"])
    new = newest_canary.render_canary_row("2026-12-05", VERSIONS, [])
    page = newest_canary.insert_canary_row(_page(same_day, old), new)
    assert page == _page(new, old)
    # an empty section takes the first row; what lies outside the markers stays
    assert newest_canary.insert_canary_row(_page(), old) == _page(old)


def test_a_page_without_the_section_is_an_error():
    with pytest.raises(ValueError, match="no canary section"):
        newest_canary.insert_canary_row("# Supported stacks\n", "- newest as of 2026-12-05: torch 2.15.0: ok")


def test_the_docs_page_has_the_section():
    assert newest_canary.CANARY_BEGIN in stack_matrix.TABLE_PAGE.read_text()


def test_stacks_beyond_the_cap_lift_it_for_their_pip_only():
    lifted = [stack for stack in stack_matrix.STACKS if stack.lift_pip_cap]
    assert lifted and all(stack.pip_env["PIP_CONSTRAINT"] == "/dev/null" for stack in lifted)
    assert all(stack.pip_env is None for stack in stack_matrix.STACKS if not stack.lift_pip_cap)


def test_wildcards_compare_the_written_prefix():
    assert newest_canary._admits("transformers==5.0.*", {"transformers": "5.25.0"}) is False
    assert newest_canary._admits("transformers==5.0.*", {"transformers": "5.0"}) is True
