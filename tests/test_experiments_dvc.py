"""Issue 36 with the real DVC, in a copy of the repository (CPU, a few steps a run):
- the declared metrics are the headline numbers (metrics/headline.json); train.json and env.json
  are detail outputs: `dvc metrics diff` has no ports, times or paths;
- `dvc exp show --only-changed --drop '.*/'` fits 120 columns with the changed params and the
  headline numbers whole;
- every declared plot compares a commit and experiments with `dvc plots diff` (no load errors;
  the memory plot's y is the run's own process-tree RSS);
- README.md's own-data quick start (between <!-- quickstart-own-data --> markers), pasted as
  written with a tiny model saved by save_pretrained and a small jsonl: `dvc add`, `dvc exp run`,
  `longft generate`; no experiment commits the data or the model to git;
- then README.md's comparison (between <!-- compare-experiments --> markers), pasted as written
  (issue 48): the baseline committed, two `dvc exp run --temp` experiments that each start from the
  committed params, and its `dvc exp show` with every changed param and the headline numbers whole
  within 120 columns.
The tests share one repository and run in file order (the width check before the own-data run, the
comparison last: it commits the own-data run onto master)."""

import json
import re
from pathlib import Path

import pytest
import yaml

from checkout_copy import copy_checkout
from longft.config.params import Config, merge, to_dict
from longft.metrics.summary import HEADLINE
from venv_shell import run

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
GIT = ("git", "-c", "user.email=t@t", "-c", "user.name=t")
PLOTS = {"metrics/loss.csv", "metrics/memory.csv", "metrics/eval.csv", "lr", "grad_norm",
         "tokens_per_s", "vram_per_step"}


def sh(*cmd, cwd, check=True):
    p = run(*cmd, cwd=cwd, check=check)
    return p.stdout + p.stderr


def quickstart_block(readme: Path, marker: str = "quickstart-own-data") -> str:
    """The shell commands between the `marker` markers of README.md."""
    text = readme.read_text()
    m = re.search(rf"<!-- {marker} -->\s*```bash\n(.*?)```\s*<!-- /{marker} -->", text, re.S)
    assert m, f"README.md has no ```bash block between the {marker} markers"
    return m.group(1)


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """A committed baseline run (synthetic data, random tiny Llama) and experiment lr-lora."""
    root = tmp_path_factory.mktemp("exps") / "repo"
    copy_checkout(root, with_tests=False)
    # the shipped params (the dataclass defaults) made quick, not the workspace's params.yaml
    params = merge(to_dict(Config()), {"data": {"num_samples": 8, "eval_samples": 4},
                                       "train": {"iterations": 3, "warmup_iterations": 1},
                                       "output": {"save_checkpoint": False}})
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    sh("git", "init", "-q", "-b", "master", cwd=root)
    sh("git", "add", "-A", cwd=root)
    sh(*GIT, "commit", "-qm", "pipeline", cwd=root)
    sh("dvc", "repro", cwd=root)
    sh("git", "add", "-A", cwd=root)
    sh(*GIT, "commit", "-qm", "run 1", cwd=root)
    # --temp: the workspace keeps the committed params, so the quick start after it does not
    # inherit lr-lora's (issue 48)
    sh("dvc", "exp", "run", "--temp", "-n", "lr-lora", "-S", "optim.lr=0.003", "-S", "lora.rank=4",
       cwd=root)
    return root


@pytest.fixture(scope="module")
def own_data(repo, byte_tokenizer):
    """README's own-data quick start, pasted as written, on a tiny saved model and a jsonl."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = repo / "models" / "my-llama"
    config = AutoConfig.from_pretrained(REPO / "configs/models/tiny-llama.json")
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    byte_tokenizer.save_pretrained(model_dir)
    (repo / "mydata").mkdir()
    # long enough for 6 packed rows: one epoch (the snippet's train.epochs 1) is 3 steps
    filler = "The sum of two equal numbers is twice the number. " * 9
    (repo / "mydata" / "train.jsonl").write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"Note {i}: {filler}What is {i} plus {i}?"},
                                 {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]})
        + "\n" for i in range(40)))
    out = sh("bash", "-e", "-c", quickstart_block(REPO / "README.md"), cwd=repo)
    return repo, out


def test_metrics_are_the_headline_and_the_detail_is_an_output(repo):
    head = json.loads((repo / "metrics/headline.json").read_text())
    assert set(head) == set(HEADLINE) and head["status"] == "complete"
    diff = json.loads(sh("dvc", "metrics", "diff", "master", "lr-lora", "--json", cwd=repo))
    assert list(diff) == ["metrics/headline.json"]  # not train.json or env.json
    assert set(diff["metrics/headline.json"]) <= set(HEADLINE)
    assert {"loss", "eval_loss"} <= set(diff["metrics/headline.json"])
    shown = json.loads(sh("dvc", "metrics", "show", "--json", cwd=repo))[""]["data"]
    assert list(shown) == ["metrics/headline.json"]  # no port, time or path among the metrics
    assert set(shown["metrics/headline.json"]["data"]) <= set(HEADLINE)
    # the detail stays beside it, committed with the run: what longft report reads
    train = json.loads(sh("git", "show", "HEAD:metrics/train.json", cwd=repo))
    assert train["status"] == "complete" and "master_port" in json.loads(
        sh("git", "show", "HEAD:metrics/env.json", cwd=repo))
    table = sh("python", "-m", "longft.cli", "report", "--names", cwd=repo)
    assert "| lr-lora (" in table and "| 0.003 | 4 |" in table and "| 0.001 | 0 |" in table


def test_exp_show_fits_120_columns_with_changed_params(repo):
    out = sh("env", "COLUMNS=120", "dvc", "exp", "show", "--no-pager", "--only-changed", "--drop",
             ".*/", cwd=repo)
    lines = out.rstrip("\n").splitlines()
    assert max(len(line) for line in lines) <= 120, out
    header = lines[1].split()
    for col in ("Experiment", "tok_s", "loss", "eval_loss", "optim.lr", "lora.rank"):
        assert col in header, out  # whole, not cut to "…"
    row = next(line for line in lines if "[lr-lora]" in line)
    assert " 0.003 " in row and " 4 " in row and "…" not in out
    # without --only-changed DVC lists every param and dep (about 120 columns): still 120 wide
    plain = sh("env", "COLUMNS=120", "dvc", "exp", "show", "--no-pager", cwd=repo)
    assert max(len(line) for line in plain.splitlines()) <= 120


def _y_fields(spec) -> set:
    if isinstance(spec, dict):
        got = {spec["y"]["field"]} if isinstance(spec.get("y"), dict) and "field" in spec["y"] \
            else set()
        return got.union(*(_y_fields(v) for v in spec.values()))
    if isinstance(spec, list):
        return set().union(*(_y_fields(v) for v in spec))
    return set()


def plots_diff(root, *revs) -> dict:
    out = json.loads(sh("dvc", "plots", "diff", *revs, "--json", cwd=root))
    assert not out.get("errors"), out.get("errors")
    data = out["data"]
    assert set(data) == PLOTS
    for name, plots in data.items():
        revisions = {r for p in plots for r in p["revisions"]}
        assert revisions == set(revs), (name, revisions)
        values = [v for p in plots for v in p["content"]["data"]["values"]]
        assert {v["rev"] for v in values} == set(revs), name
    return data


def test_every_plot_compares_a_commit_and_experiments(repo):
    data = plots_diff(repo, "master", "lr-lora")
    memory = data["metrics/memory.csv"][0]["content"]
    assert _y_fields(memory) == {"rss_tree_gib"}  # the run's own memory, not the machine's
    assert _y_fields(data["vram_per_step"][0]["content"]) == {"vram_alloc_gib"}


def test_quickstart_snippet_pasted_as_written(own_data):
    root, out = own_data
    head = json.loads(sh("git", "show", "refs/exps/" + _exp_ref(root, "my-data")
                         + ":metrics/headline.json", cwd=root))
    assert head["status"] == "complete" and head["eval_loss"] > 0
    params = yaml.safe_load((root / "params.yaml").read_text())
    assert params["data"]["path"] == "mydata/train.jsonl" and params["data"]["num_samples"] is None
    assert params["model"] == {**params["model"], "source": "pretrained", "name": "models/my-llama"}
    assert params["data"]["max_seq_length"] == 4096  # the rest of each section as it was
    # one pass over the user's rows, not the demo's step count (train.iterations)
    assert (params["train"]["iterations"], params["train"]["epochs"]) == (None, 1)
    train = json.loads(sh("git", "show", "refs/exps/" + _exp_ref(root, "my-data")
                          + ":metrics/train.json", cwd=root))
    assert train["steps"] == 3 and train["epochs"] == pytest.approx(1.0)  # 6 rows, 2 a step
    stats = json.loads((root / "data/prepared/stats.json").read_text())
    assert stats["source"] == "jsonl" and stats["samples"] == 36  # 40 records, 4 held out
    assert "--- reference" in out and "plus" in out  # longft generate answered held-out records


def _exp_ref(root, name) -> str:
    refs = sh("git", "for-each-ref", "--format=%(refname)", "refs/exps", cwd=root).split()
    ref = next(r for r in refs if r.endswith("/" + name))
    return ref.removeprefix("refs/exps/")


def test_no_experiment_commits_the_data_or_the_model_to_git(own_data):
    root, _ = own_data
    for ref in sh("git", "for-each-ref", "--format=%(refname)", "refs/exps", cwd=root).split():
        files = sh("git", "ls-tree", "-r", "-l", ref, cwd=root).splitlines()
        paths = {line.split("\t")[1]: int(line.split()[3]) for line in files}
        assert not [p for p in paths if p.startswith(("models/my-llama/", "data/prepared/",
                                                      "export/", "runs/", "checkpoints/"))]
        assert "mydata/train.jsonl" not in paths
        assert max(paths.values()) < 1_000_000, sorted(paths.items(), key=lambda kv: -kv[1])[:3]
        if ref.endswith("/my-data"):
            assert {"mydata/train.jsonl.dvc", "models/my-llama.dvc"} <= set(paths)


def test_plots_compare_the_own_data_experiment_too(own_data):
    root, _ = own_data
    plots_diff(root, "master", "lr-lora", "my-data")


@pytest.fixture(scope="module")
def compared(own_data):
    """README's comparison after the own-data quick start, pasted as written (the table apart)."""
    root, _ = own_data
    block = quickstart_block(REPO / "README.md", "compare-experiments")
    show = [line for line in block.splitlines() if line.startswith("dvc exp show")]
    assert len(show) == 1, block
    sh("bash", "-e", "-c", block.replace(show[0], ""), cwd=root)
    return root, show[0].split("#")[0].strip()


def test_compared_experiments_each_start_from_the_committed_params(compared):
    root, _ = compared
    committed = yaml.safe_load(sh("git", "show", "HEAD:params.yaml", cwd=root))
    assert committed["data"]["path"] == "mydata/train.jsonl"   # the own-data run is the baseline
    assert (committed["optim"]["lr"], committed["lora"]["rank"]) == (0.001, 0)  # not lr-lora's
    assert (root / "params.yaml").read_text() == sh("git", "show", "HEAD:params.yaml", cwd=root)
    for name, changed in (("rank-8", {("lora", "rank"): 8}), ("lr-3e-4", {("optim", "lr"): 3e-4})):
        ref = "refs/exps/" + _exp_ref(root, name)
        params = yaml.safe_load(sh("git", "show", ref + ":params.yaml", cwd=root))
        expected = merge(committed, {k[0]: {k[1]: v} for k, v in changed.items()})
        assert params == expected, name    # no other experiment's params leaked in
        head = json.loads(sh("git", "show", ref + ":metrics/headline.json", cwd=root))
        assert head["status"] == "complete", name


def test_compared_exp_show_fits_120_columns_with_every_changed_param(compared):
    root, show = compared
    out = sh("env", "COLUMNS=120", "bash", "-c", show + " --no-pager", cwd=root)
    lines = out.rstrip("\n").splitlines()
    widths = [len(line) for line in lines]
    assert max(widths) <= 120, out
    assert "…" not in out, out   # no param or number cut
    header = " ".join(lines[:3])
    for col in ("Experiment", "lora.rank", "optim.lr", "loss", "eval_loss", "tok_s"):
        assert col in header.split(), (col, out)
    assert re.search(r"\[rank-8\] .* 0\.001 +8 ", out), out        # lr from the committed params
    assert re.search(r"\[lr-3e-4\] .* 0\.0003 +0 ", out), out      # rank too, not rank-8's
