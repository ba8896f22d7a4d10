"""Every reader of params-shaped YAML uses the strict loader (config/typed_yaml.py): a key given
twice is refused with both lines, never silently the last one kept (issue 20)."""

import importlib.util

import pytest
import yaml

from longft.config.params import Config, ConfigError, from_dict, to_dict
from longft.run import confirm, sweep
from longft.run.pipeline import REPO
from test_plan import CPU  # noqa: E402  (tests/ is on sys.path under pytest)

DUP = "train:\n  iterations: 4\n  iterations: 400\n"
TWICE = r"key 'iterations' is given twice \(lines 2 and 3\)"


def shipped(path):
    path.write_text(yaml.safe_dump(to_dict(Config()), sort_keys=False))
    return path


def test_sweep_refuses_a_repeated_key_in_the_grid_and_in_the_base(tmp_path):
    base = shipped(tmp_path / "params.yaml")
    grid = tmp_path / "grid.yaml"
    grid.write_text("- name: a\n  train.iterations: 4\n  train.iterations: 400\n")
    with pytest.raises(sweep.SweepError, match=r"key 'train.iterations' is given twice") as e:
        sweep.load(grid, base)
    assert str(grid) in str(e.value)
    grid.write_text("- name: a\n  train.iterations: 4\n")
    assert [r.name for r in sweep.load(grid, base)] == ["a"]
    base.write_text(DUP)
    with pytest.raises(sweep.SweepError, match=TWICE) as e:
        sweep.load(grid, base)
    assert str(base) in str(e.value)


def bench_module():
    spec = importlib.util.spec_from_file_location("bench_script", REPO / "scripts" / "bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_overlays_refuse_a_repeated_key(tmp_path):
    bench = bench_module()
    base = shipped(tmp_path / "base.yaml")
    overlay = tmp_path / "row.yaml"
    overlay.write_text("bench_note: x\n" + DUP)
    with pytest.raises(ConfigError, match=r"key 'iterations' is given twice \(lines 3 and 4\)") as e:
        bench.overlay_params(overlay, base)
    assert str(overlay) in str(e.value)
    overlay.write_text("bench_note: x\ntrain:\n  iterations: 4\n")
    params, _, note = bench.overlay_params(overlay, base)
    assert params["train"]["iterations"] == 4 and note == "x"


def test_max_context_confirm_refuses_a_repeated_key(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(DUP)
    with pytest.raises(ConfigError, match=TWICE):
        confirm.prepare(str(params), from_dict({}), CPU, model_type="llama", estimated={}, gpu_mem=16.0,
                        host_mem=None, iterations=2, work=tmp_path,
                        out=None)


def test_merge_keys_still_work_and_may_be_overridden():
    from longft.config.typed_yaml import DuplicateKeyError, load_yaml

    text = "common: &c {a: 1, b: 2}\nrow: {<<: *c, b: 3}\n"
    assert load_yaml(text)["row"] == {"a": 1, "b": 3}
    with pytest.raises(DuplicateKeyError, match="key 'b' is given twice"):
        load_yaml("common: &c {a: 1}\nrow: {<<: *c, b: 3, b: 4}\n")
