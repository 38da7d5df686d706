"""Reading a recipe file: a key given twice is refused with both line numbers (it used to run as the last one), a
binary file is refused naming the file, and the safe loader still runs no ``!!python`` tag."""

from __future__ import annotations

import pytest

from stitch.config.recipe import load_recipe
from stitch.config.yaml_io import RecipeFileError, read_yaml_file
from tests.stitch_testing import write_recipe


def test_a_top_level_key_given_twice_is_refused_with_both_line_numbers(tmp_path):
    path = write_recipe(tmp_path / "r.yaml")
    path.write_text(path.read_text() + "name: dup\n")  # `name: small` is on line 1
    last = len(path.read_text().splitlines())
    with pytest.raises(RecipeFileError, match=rf"key 'name' appears twice in one mapping, on line 1 and on line "
                                              rf"{last}") as err:
        load_recipe(path)
    assert str(path) in str(err.value)


def test_a_nested_key_given_twice_is_refused_but_the_same_key_in_two_mappings_is_not(tmp_path):
    path = tmp_path / "n.yaml"
    path.write_text("a:\n  steps: 1\n  x: 2\n  steps: 3\nb:\n  steps: 4\n")
    with pytest.raises(RecipeFileError, match=r"key 'steps' appears twice in one mapping, on line 2 and on line 4"):
        read_yaml_file(path)
    path.write_text("a:\n  steps: 1\nb:\n  steps: 4\n")
    assert read_yaml_file(path) == {"a": {"steps": 1}, "b": {"steps": 4}}


def test_a_binary_recipe_file_is_refused_naming_the_file_and_the_byte(tmp_path):
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"name: x\n\xff\xfe\x00garbage")
    with pytest.raises(RecipeFileError, match=r"is not UTF-8 text: byte 0xff at offset 8") as err:
        load_recipe(path)
    assert str(path) in str(err.value)


def test_a_python_tag_is_refused_and_runs_no_code(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.yaml"
    path.write_text(f"name: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(RecipeFileError, match="not valid YAML"):
        read_yaml_file(path)
    assert not marker.exists()
