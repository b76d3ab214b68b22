"""An `OPSD_*` line in a recipe file (issue 60 item 7): switches and script variables are
environment variables, one place each (docs/SPEC.md §6); the recipe refuses them with one line
that says where they go, instead of "unknown key"."""
import json

import pytest

from opsd.config import RecipeError, parse_recipe


@pytest.mark.parametrize("line, variable, value", [
    ("OPSD_CLIP_MODE=token", "OPSD_CLIP_MODE", "token"),  # a switch
    ("export OPSD_PAD_SIDE='left'  # the arm that learns", "OPSD_PAD_SIDE", "left"),  # as a shell file writes it
    ("OPSD_OUTPUT=runs/x", "OPSD_OUTPUT", "runs/x"),  # a script variable
])
def test_an_opsd_variable_in_a_recipe_file_says_it_belongs_in_the_environment(tmp_path, line, variable, value):
    path = tmp_path / "my.env"
    path.write_text(f"lr_scheduler_type=cosine\n{line}\n")
    with pytest.raises(RecipeError) as info:
        parse_recipe(path)
    assert str(info.value) == (
        f"{path}:2: {variable} is an environment variable, not a recipe key: set it in the environment "
        f'({variable}={value} bash train_capped.sh RECIPE) or in a grid arm\'s "env"')


def test_a_grid_recipe_with_a_switch_names_the_arm_and_the_hint(tmp_path):
    from opsd.research.grid import GridError, load_grid

    grid = tmp_path / "g.json"
    grid.write_text(json.dumps({"arms": {"base": {"train": False},
                                         "token": {"recipe": {"OPSD_CLIP_MODE": "token"}}}}))
    with pytest.raises(GridError) as info:
        load_grid(str(grid))
    assert str(info.value) == (
        f"{grid}: arm 'token': recipe:2: OPSD_CLIP_MODE is an environment variable, not a recipe key: set it in "
        "the environment (OPSD_CLIP_MODE=token bash train_capped.sh RECIPE) or in a grid arm's \"env\"")
