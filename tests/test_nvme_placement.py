"""NVMe offload in the placement search (issue 51): the smaller sub-groups that the host's swap
buffers ask for, the disk's measured rates in the speed, and NVMe answers that carry their path."""

import dataclasses
import json
import re

import pytest

from longft.cli.estimate import main
from longft.config.params import Config, from_dict, merge, to_dict
from longft.engine import ds_config
from longft.estimate.estimator import GIB
from longft.estimate.placement import best, search
from longft.estimate.placement_overlay import overlay
from longft.hardware import nvme
from test_optimizer_placement import BASE_8B, REPO
from test_placement_advice import _overlay_after
from test_plan import CPU


def test_nvme_where_the_host_is_short_takes_smaller_sub_groups():
    """The H200 NVMe row's question (Llama-3.2-3B at 32K, 24 GiB + 32 GiB): at the default 1e9
    sub-groups the swapper's buffers and the first step's m, v need 35.7 GiB of RAM, so only the
    1e8 sub-groups (NVME_SUB_GROUP_SIZE) fit, the candidate says so, and the overlay sets them.
    Both sizes are searched; where both fit (64 GiB) the one that uses less of the machine wins,
    as the disk moves the same bytes; without NVMe the params' own size is the only one."""
    from longft.config.params import Config, merge, to_dict
    from longft.estimate.placement import NVME_SUB_GROUP_SIZE, describe_placement

    arch = json.loads((REPO / "configs/models/llama3.2-3b.json").read_text())
    base = dataclasses.replace(BASE_8B, seq_len=32768, checkpointing="gpu")
    kw = dict(gpu_mem_gib=24, gpu_name=None, max_micro=1, disk_gib=60, offloads=("opt(nvme)",))
    short = [c for c in search(arch, base, host_mem_gib=32, **kw) if c.fit.ok]
    assert short and {c.setup.sub_group_size for c in short} == {NVME_SUB_GROUP_SIZE}
    assert all(c.est.host_rss < 32 * GIB for c in short)
    assert "sub-groups 100,000,000" in describe_placement(short[0])
    ov = overlay(short[0], 1, nvme_path="/tmp/x")
    assert ov["zero"]["sub_group_size"] == NVME_SUB_GROUP_SIZE and ov["zero"]["nvme_path"] == "/tmp/x"
    cfg = from_dict(merge(to_dict(Config()), {**ov, "model": {"name": "llama3.2-3b"}}))
    assert cfg.zero.sub_group_size == NVME_SUB_GROUP_SIZE          # merged onto params, it validates
    assert ds_config.build(cfg, "bf16", 64)["zero_optimization"]["sub_group_size"] == NVME_SUB_GROUP_SIZE
    roomy = [c for c in search(arch, base, host_mem_gib=64, **kw) if c.fit.ok]
    assert {c.setup.sub_group_size for c in roomy} == {base.sub_group_size, NVME_SUB_GROUP_SIZE}
    pick = best(roomy, gpu_mem_gib=24, host_mem_gib=64)
    assert pick.setup.sub_group_size == NVME_SUB_GROUP_SIZE
    assert pick.est.host_rss == min(c.est.host_rss for c in roomy if c.setup.checkpointing ==
                                    pick.setup.checkpointing and c.setup.micro_batch == 1)
    cpu = search(arch, base, host_mem_gib=64, gpu_mem_gib=80, gpu_name=None, max_micro=1,
                 offloads=("opt",))
    assert {c.setup.sub_group_size for c in cpu} == {base.sub_group_size}
    assert "sub-groups" not in describe_placement(cpu[0])


def test_nvme_speed_at_the_disk_s_measured_rates(tmp_path, capsys, monkeypatch):
    """The H200 NVMe row (135a550) predicted at the bandwidth measured on its disk in the same call
    (read 1.71, write 2.61 GiB/s) is within 5 % of its measured tok/s, where the assumed 2e9 B/s
    each way is 10 % low; `longft placement --disk-bandwidth` takes that JSON, and refuses a bad one
    or one without --nvme-path before searching."""
    from longft.cli.estimate import main
    from longft.estimate.estimator import setup_from_config
    from longft.estimate.speed import tokens_per_second
    from longft.model.architecture import architecture
    from longft.model.loading import load_model_config

    res = REPO / "bench/results"
    row = json.loads((res / "h200-3b-32k-nvme-cap24-host32.json").read_text())
    cfg = from_dict(row["params"])
    arch = architecture(load_model_config(cfg.model))
    s = setup_from_config(cfg, row["plan"]["resolved"])
    read, write = nvme.bandwidth(str(res / "h200-3b-32k-nvme-cap24-host32-disk.json"))
    measured = row["train"]["tokens_per_s"]
    assumed = tokens_per_second(arch, s, "NVIDIA H200")
    at_disk = tokens_per_second(arch, dataclasses.replace(s, disk_read_bps=read, disk_write_bps=write),
                                "NVIDIA H200")
    assert abs(at_disk / measured - 1) < 0.05 < abs(assumed / measured - 1), (at_disk, assumed, measured)
    from longft.estimate.speed import NVME_BYTES_PER_S, step_seconds

    states = 16 * 3_212_749_824           # fp32 master, gradient, m, v: read and written once a step
    for r, w in ((read, NVME_BYTES_PER_S), (NVME_BYTES_PER_S, write)):   # each way at its own rate
        one = dataclasses.replace(s, disk_read_bps=r, disk_write_bps=w)
        got = step_seconds(arch, one, "NVIDIA H200") - step_seconds(arch, s, "NVIDIA H200")
        assert got == pytest.approx(states / r + states / w - 2 * states / NVME_BYTES_PER_S, rel=1e-6)

    monkeypatch.setattr("longft.hardware.detect", lambda: CPU)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "swap").mkdir()
    ask = ["--gpu-mem", "24", "--host-mem", "32", "--model", "llama3.2-3b", "--seq", "32768",
           "--lora", "none", "--max-micro", "1", "--nvme-path", str(tmp_path / "swap")]
    assert main("placement", ask + ["--disk-bandwidth", str(res / "h200-3b-32k-nvme-cap24-host32-disk.json")]) == 0
    assert "NVMe speed at" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text(json.dumps({"read_gib_s": 1.7}))
    assert main("placement", ask + ["--disk-bandwidth", str(tmp_path / "bad.json")]) == 2
    assert "no positive 'write_gib_s'" in capsys.readouterr().err
    assert main("placement", ask[:-2] + ["--disk-bandwidth", str(tmp_path / "bad.json")]) == 2
    assert "give --nvme-path" in capsys.readouterr().err
    assert main("placement", ask) == 0
    assert "NVMe speed assumes" in capsys.readouterr().out


def test_nvme_answers_carry_their_path_and_their_sub_groups(tmp_path, monkeypatch, capsys):
    """With --nvme-path the longest-context search and the changes search NVMe at the smaller
    sub-groups too (the host holds six states of the largest one), and every overlay that puts the
    states on NVMe names the path (an overlay with nvme_path null would not validate); without
    --nvme-path no NVMe answer is recommended."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("longft.hardware.detect", lambda: CPU)
    swap = tmp_path / "swap"
    swap.mkdir()
    asked = ("--gpu-mem 24 --host-mem 32 --model llama3.2-3b --seq 131072 --lora none "
             "--max-micro 1").split()
    assert main("placement", asked + ["--nvme-path", str(swap)]) == 1
    out = capsys.readouterr().out
    longest = out[out.index("longest context that fits"):out.index("changes that make")]
    m = re.search(r"full-parameter\s+([\d,]+) tokens", longest)
    assert m and int(m.group(1).replace(",", "")) >= 65536, longest
    assert "opt(nvme) sub-groups 100,000,000" in longest
    for line in out.splitlines():
        if line.strip().startswith("overlay: {") and "offload_optimizer: nvme" in line:
            assert f"nvme_path: {swap}" in line, line
    rec = _overlay_after(out, "# longft placement, instead of the asked run")
    assert rec["zero"]["offload_optimizer"] == "nvme"     # bf16 states over NVMe, 1e8 sub-groups
    assert rec["zero"]["nvme_path"] == str(swap) and from_dict(merge(to_dict(Config()), rec))
    assert main("placement", asked) == 1
    out = capsys.readouterr().out
    rec = _overlay_after(out, "# longft placement, instead of the asked run")
    assert rec["zero"]["offload_optimizer"] != "nvme" and rec["lora"]["rank"] == 16
