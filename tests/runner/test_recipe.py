"""Recipe loading: shipped recipes load, every error names the file, line, key and what is allowed."""
from __future__ import annotations

from pathlib import Path

import pytest

from batchinfer.engine.config import EngineConfig, SchedulerConfig
from batchinfer.runner.recipe import Recipe, RecipeError, load_recipe, parse_recipe
from batchinfer.strategies import STRATEGIES, BaselineStrategy

REPO = Path(__file__).resolve().parents[2]


def _load(tmp_path, text: str) -> Recipe:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return load_recipe(path)


def _problems(tmp_path, text: str) -> list[str]:
    with pytest.raises(RecipeError) as info:
        _load(tmp_path, text)
    assert str(tmp_path / "recipe.yaml") in str(info.value)
    return info.value.problems


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "recipes").glob("*.yaml")))
def test_shipped_recipes_load(name):
    recipe = load_recipe(REPO / "recipes" / name)
    assert isinstance(recipe.engine_config(), EngineConfig)


def test_one_recipe_per_registered_strategy():
    shipped = {load_recipe(p).strategy.name for p in (REPO / "recipes").glob("*.yaml")}
    assert set(STRATEGIES) <= shipped


def test_empty_recipe_is_all_defaults(tmp_path):
    recipe = _load(tmp_path, "")
    assert recipe == Recipe()
    assert recipe.strategy.name == "baseline"
    assert recipe.engine_config().scheduler == SchedulerConfig()


def test_a_section_with_every_key_commented_out_is_empty(tmp_path):
    """`model:` with nothing under it reads as null in YAML: the section's defaults (it was a
    pydantic message naming an internal class)."""
    recipe = _load(tmp_path, "model:\n  # path: x\nsampling:\n  max_tokens: 4\nstrategy:\n")
    assert recipe.model == Recipe().model and recipe.sampling.max_tokens == 4
    assert recipe.strategy.name == "baseline"


def test_sections_compose_engine_config(tmp_path):
    recipe = _load(tmp_path, """
model: {dtype: float32, max_model_len: 1024}
strategy: {name: baseline, policy: sb, max_num_seqs: 8}
memory: {kv_cache_memory: 64MiB, block_size: 32}
device: {device: cpu, num_threads: 2}
sampling: {temperature: 0, max_tokens: 5}
""")
    cfg = recipe.engine_config()
    assert cfg.model.max_model_len == 1024 and cfg.model.dtype == "float32"
    assert cfg.scheduler.policy == "sb" and cfg.scheduler.max_num_seqs == 8
    assert cfg.cache.kv_cache_memory == 64 * 2**20 and cfg.cache.block_size == 32
    assert cfg.device.num_threads == 2
    assert recipe.sampling.max_tokens == 5 and recipe.sampling.greedy
    assert recipe.max_in_flight == 16


def test_resolved_yaml_round_trips(tmp_path):
    recipe = _load(tmp_path, "strategy: {name: baseline, chunk_size: 64}\nio: {output_order: input}\n")
    again = _load(tmp_path, recipe.to_yaml())
    assert again == recipe
    assert isinstance(again.strategy, BaselineStrategy) and again.strategy.chunk_size == 64


def test_unknown_key_suggests_closest_and_names_line(tmp_path):
    problems = _problems(tmp_path, "model:\n  dtype: auto\nio:\n  ouput_dir: out\n")
    assert len(problems) == 1
    text = problems[0]
    assert text.startswith("line 4, io.ouput_dir: unknown key")
    assert "did you mean 'output_dir'" in text
    assert "Allowed keys:" in text and "output_order" in text


def test_vllms_parallel_size_names_suggest_the_recipes_keys(tmp_path):
    """parallel: {pipeline_parallel_size: 2}, as a vLLM user writes it, is refused with the key
    it stands for (no spelling of 'pp' is close enough for the closest-key hint)."""
    (text,) = _problems(tmp_path, "parallel:\n  pipeline_parallel_size: 2\n")
    assert text.startswith("line 2, parallel.pipeline_parallel_size: unknown key; "
                           "did you mean 'pp'?")
    (text,) = _problems(tmp_path, "parallel: {tensor_parallel_size: 2}\n")
    assert "did you mean 'tp'?" in text


def test_unknown_top_level_section(tmp_path):
    (text,) = _problems(tmp_path, "sampleing:\n  temperature: 0\n")
    assert "did you mean 'sampling'" in text and "line 1" in text


def test_every_problem_is_listed(tmp_path):
    problems = _problems(tmp_path, """
model:
  dtype: fp8
sampling:
  temperature: -1
  top_pp: 0.5
strategy:
  name: baseline
  max_num_seq: 4
""")
    joined = "\n".join(problems)
    assert len(problems) == 4
    assert "line 3, model.dtype" in joined and "'float32'" in joined and "(got 'fp8')" in joined
    assert "line 5, sampling.temperature: Input should be greater than or equal to 0" in joined
    assert "did you mean 'top_p'" in joined
    assert "line 9, strategy.max_num_seq" in joined and "did you mean 'max_num_seqs'" in joined


def test_unknown_strategy_lists_known_ones(tmp_path):
    (text,) = _problems(tmp_path, "strategy:\n  name: tdpip\n")
    assert "line 2, strategy.name: unknown strategy 'tdpip'" in text
    assert "Known strategies: baseline" in text


def test_strategy_must_be_a_mapping(tmp_path):
    (text,) = _problems(tmp_path, "strategy: [1, 2]\n")
    assert "strategy: must be a mapping" in text


def test_a_check_of_two_keys_points_at_the_first_key_it_names(tmp_path):
    """A section's check across its keys (pydantic model validators) is located at the line of
    the first key its message names, not at the section's line."""
    (text,) = _problems(tmp_path, "strategy:\n  name: gllm\n  # the bounds\n  MaxP: 32\n"
                                  "  MinP: 64\n")
    assert text == "line 5, strategy.MinP: MinP (64) must not exceed MaxP (32)"
    (text,) = _problems(tmp_path, "sampling:\n  max_tokens: 4\n  min_tokens: 9\n")
    assert text.startswith("line 3, sampling.min_tokens: min_tokens (9) must be <=")
    (text,) = _problems(tmp_path, "strategy:\n  name: tdpipe\n  future_point_interval: 9\n"
                                  "  future_point_horizon: 4\n")
    assert text.startswith("line 4, strategy.future_point_horizon: future_point_horizon must")


def test_strategy_as_plain_name(tmp_path):
    assert _load(tmp_path, "strategy: baseline\n").strategy.name == "baseline"


def test_parallel_layout_is_accepted_and_reaches_the_engine(tmp_path):
    recipe = _load(tmp_path, "parallel:\n  tp: 2\n  pp: 2\n  dp: 1\n")
    assert (recipe.engine_config().parallel.tp, recipe.engine_config().parallel.pp) == (2, 2)


def test_pipeline_split_must_list_one_count_per_stage(tmp_path):
    (text,) = _problems(tmp_path, "parallel:\n  pp: 2\n  pp_layers: [10, 10, 10]\n")
    assert "line 3, parallel.pp_layers: lists 3 stages but pp is 2" in text


def test_parallel_values_are_checked(tmp_path):
    (text,) = _problems(tmp_path, "parallel: {tp: 0}\n")
    assert "parallel.tp" in text and "greater than or equal to 1" in text


def test_predictor_names_and_paths(tmp_path):
    (text,) = _problems(tmp_path, "predictor: {name: bret}\n")
    assert "predictor.name" in text and "'none'" in text and "'bert'" in text
    (text,) = _problems(tmp_path, "predictor: {name: bert}\n")
    assert "line 1, predictor.path" in text and "needs a path" in text
    (text,) = _problems(tmp_path, f"predictor:\n  name: bert\n  path: {tmp_path}\n")
    assert "line 3, predictor.path" in text and "no predictor.json" in text


def test_bad_sizes(tmp_path):
    problems = _problems(tmp_path, "memory: {kv_cache_memory: lots}\nio: {max_line_bytes: -3}\n")
    joined = "\n".join(problems)
    assert "memory.kv_cache_memory: 'lots' is not a size" in joined
    assert "io.max_line_bytes" in joined


def test_yaml_syntax_error_names_line(tmp_path):
    (text,) = _problems(tmp_path, "model:\n  dtype: [auto\n")
    assert "not valid YAML" in text and "line" in text


def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path):
    """YAML keeps the last of two equal keys: a second `sampling:` would drop the first
    section's temperature without a word."""
    (text,) = _problems(tmp_path, "sampling:\n  max_tokens: 4\n  temperature: 0\n"
                                  "model: {max_model_len: 512}\nsampling:\n  max_tokens: 8\n")
    assert "key 'sampling' given twice (lines 1 and 5)" in text
    (text,) = _problems(tmp_path, "sampling: {max_tokens: 4, max_tokens: 9}\n")
    assert "key 'max_tokens' given twice" in text
    merged = _load(tmp_path, "sampling:\n  <<: {max_tokens: 4, temperature: 0}\n"
                             "  max_tokens: 8\n")              # a merge key's override stays allowed
    assert merged.sampling.max_tokens == 8 and merged.sampling.temperature == 0


def test_recipe_must_be_a_mapping(tmp_path):
    (text,) = _problems(tmp_path, "- model\n- io\n")
    assert "must be a mapping of sections" in text


def test_missing_file():
    with pytest.raises(RecipeError) as info:
        load_recipe("/nonexistent/recipe.yaml")
    assert "no such file" in str(info.value)


def test_recipe_never_executes_code(tmp_path):
    # a python tag is a YAML error for safe_load, not an object construction
    (text,) = _problems(tmp_path, "model: !!python/object/apply:os.system ['echo hi']\n")
    assert "not valid YAML" in text


def test_parse_recipe_from_dict():
    recipe = parse_recipe({"strategy": {"name": "baseline", "policy": "sb"}})
    assert recipe.strategy.scheduler_config().policy == "sb"
    # Python construction takes a dict for the strategy as well
    assert Recipe(strategy={"name": "baseline", "max_num_seqs": 3}).strategy.max_num_seqs == 3


def test_a_boolean_is_not_a_number(tmp_path):
    """pydantic would read true as 1: one token, one pipeline stage."""
    problems = _problems(tmp_path, "sampling:\n  max_tokens: true\nparallel:\n  pp: false\n"
                                   "  pp_layers: [true, true]\n"
                                   "strategy:\n  name: baseline\n  max_num_seqs: true\n")
    joined = "\n".join(problems)
    assert "line 2, sampling.max_tokens" in joined and "a number is needed, not true" in joined
    assert "line 4, parallel.pp" in joined and "not false" in joined
    assert "line 5, parallel.pp_layers" in joined and "item 0 is true" in joined
    assert "strategy.max_num_seqs" in joined and len(problems) == 4


def test_a_value_no_member_of_a_union_takes_is_one_problem_at_the_key(tmp_path):
    """pydantic reports each member it tried (`.int`, `.str`): the user wrote one key."""
    (text,) = _problems(tmp_path, "memory:\n  kv_cache_memory: 1.5\n")
    assert text.startswith("line 2, memory.kv_cache_memory: ") and ".int" not in text
    assert "valid integer" in text and "valid string" in text
    (text,) = _problems(tmp_path, "model:\n  dtype: null\n")
    assert text.endswith("(got null)")                  # as YAML spells it, not None


def test_union_tags_are_dropped_but_keys_and_indices_are_not(tmp_path):
    problems = _problems(tmp_path, "sampling:\n  str: 1\n  stop: ['a', 5]\n")
    joined = "\n".join(problems)
    assert "line 2, sampling.str: unknown key" in joined and "top_p" in joined   # sampling's
    assert "sampling.stop[1]: Input should be a valid string (got 5)" in joined


def test_engine_errors_get_the_recipe_line_only_for_recipe_keys(tmp_path):
    from batchinfer.runner.recipe_errors import located

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  path: x\nparallel:\n  pp: 6\n")
    assert (located("parallel.pp: pp=6 stages", str(recipe))
            == f"{recipe} line 4, parallel.pp: pp=6 stages")
    assert located("parallel.tp: heads", str(recipe)).startswith(f"{recipe} line 3, ")  # its section
    for other in ("model.v2 already holds results", "step_times.json: not a table"):
        assert located(other, str(recipe)) == other          # a file name, not a key
