"""GPU tests (run with `pytest -m gpu` on a CUDA machine; scripts/gpu_suite.sh does it)."""

import gc
import json

import pytest
import yaml

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _tiny(dtype):
    from transformers import AutoModelForCausalLM

    from longft.config.params import ModelConfig
    from longft.model.loading import load_model_config

    cfg = load_model_config(ModelConfig(name="tiny-llama"))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa").cuda()


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-3), (torch.bfloat16, 3e-2)])
def test_liger_matches_unpatched_model(dtype, rtol, monkeypatch):
    import copy

    from transformers.models.llama import modeling_llama

    from longft.model.patches import apply

    # Liger also swaps module-level classes/functions; restore them after this test.
    for name in ("LlamaRMSNorm", "LlamaMLP", "apply_rotary_pos_emb"):
        monkeypatch.setattr(modeling_llama, name, getattr(modeling_llama, name))

    ref = _tiny(dtype)
    patched = copy.deepcopy(ref)
    ids = torch.randint(1, 380, (2, 512), device="cuda")
    loss_ref, g_ref = _loss_and_grads(ref, ids)
    record = apply(patched, liger=True, checkpointing="none")
    assert record["replaced_modules"]["LlamaRMSNorm->LigerRMSNorm"] == 5  # 2 per layer + final
    assert record["replaced_modules"]["LlamaMLP->LigerSwiGLUMLP"] == 2
    assert "liger" in record["forward"] and "liger" in record["rotary"]
    loss, g = _loss_and_grads(patched, ids)
    torch.testing.assert_close(loss.float(), loss_ref.float(), rtol=rtol, atol=rtol)
    for n in g_ref:
        err = (g[n].float() - g_ref[n].float()).norm() / g_ref[n].float().norm().clamp_min(1e-12)
        assert err < rtol * 3, f"{n}: relative gradient error {err:.2e}"


def test_pipeline_on_gpu_with_liger_under_zero3(tmp_path):
    """The default tiny pipeline on CUDA: Liger's fused loss under ZeRO-3 partitioning, CPU Adam."""
    from longft.config.params import Config, merge, to_dict
    from longft.run.pipeline import run_all

    params = merge(to_dict(Config()),
                   {"train": {"iterations": 8, "warmup_iterations": 2},
                    "output": {"save_checkpoint": False}, "hardware": {"device": "cuda"}})
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump(params))
    run_all(p, tmp_path)
    plan = json.loads((tmp_path / "artifacts/plan.json").read_text())
    assert plan["resolved"]["liger"]["value"] is True
    assert plan["patches"]["loss"] == "liger_fused_linear_cross_entropy"
    m = json.loads((tmp_path / "metrics/train.json").read_text())
    assert m["status"] == "complete" and m["steps"] == 8
    assert m["loss"]["last"] < m["loss"]["first"]
    assert m["peak_vram"]["max_allocated_gib"] > 0
    assert m["peak_vram"]["nvml_used_gib"] >= m["peak_vram"]["max_reserved_gib"]
    env = json.loads((tmp_path / "metrics/env.json").read_text())
    assert env["gpu_name"] and env["precision"] in ("bf16", "fp16")


def test_vram_limit_caps_the_allocator():
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(2 * 2**30 / total, 0)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(3 * 2**30, dtype=torch.uint8, device="cuda")
        x = torch.empty(1 * 2**30, dtype=torch.uint8, device="cuda")
        del x
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        torch.cuda.empty_cache()


STRICT = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
          "math": "MATH"}


@pytest.mark.parametrize("backend", ["flash", "cudnn", "efficient"])
def test_sdpa_backends_match_math_and_really_run(backend, monkeypatch):
    """Each pinned kernel runs alone (no fallback allowed) and matches the math kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers.integrations import sdpa_attention

    from longft.model.attention import expand_kv_heads

    monkeypatch.setattr(sdpa_attention, "use_gqa_in_sdpa", sdpa_attention.use_gqa_in_sdpa)
    model = _tiny(torch.bfloat16)
    ids = torch.randint(1, 380, (2, 1024), device="cuda")
    with sdpa_kernel([SDPBackend.MATH]):
        loss_ref, g_ref = _loss_and_grads(model, ids)
    if backend == "efficient":
        expand_kv_heads()  # the V100 path: the efficient kernel rejects enable_gqa
    with sdpa_kernel([getattr(SDPBackend, STRICT[backend])]):
        loss, g = _loss_and_grads(model, ids)
    torch.testing.assert_close(loss.float(), loss_ref.float(), rtol=2e-2, atol=2e-2)
    for n in g_ref:
        err = (g[n].float() - g_ref[n].float()).norm() / g_ref[n].float().norm().clamp_min(1e-12)
        assert err < 5e-2, f"{backend} {n}: relative gradient error {err:.2e}"


@pytest.mark.parametrize("backend", ["cudnn", "flash", "efficient"])
def test_packed_documents_stay_separated_under_each_kernel_order(backend):
    import numpy as np

    from longft.data.packing import build_row
    from longft.data.tokenize import Sample
    from longft.model.attention import context

    model = _tiny(torch.float32).eval()
    a = Sample(np.arange(1, 200, dtype=np.int32), np.arange(1, 200, dtype=np.int32), "a")
    b = Sample(np.arange(30, 330, dtype=np.int32) % 380, np.arange(30, 330, dtype=np.int32) % 380, "b")
    ids, _, pos = (torch.from_numpy(x).long()[None].cuda() for x in build_row([a, b], 512, 258))
    with torch.no_grad(), context(backend):
        alone = model(input_ids=ids[:, 199:499], use_cache=False).logits
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits[:, 199:499]
    torch.testing.assert_close(packed, alone, rtol=2e-3, atol=2e-3)


def _mid_model():
    """8 layers x hidden 1024: layer inputs large enough to see in the allocator."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, vocab_size=384,
                      max_position_embeddings=16384)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    m.config.use_cache = False
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return m


@pytest.mark.parametrize("gpu_layers,prefetch", [(0, True), (3, True), (0, False)])
def test_cpu_offload_checkpoints_same_grads_and_frees_what_it_moves(gpu_layers, prefetch):
    from longft.model.patches import offload_checkpoints

    model = _mid_model()
    offloader = offload_checkpoints(model, gpu_layers, prefetch=prefetch)
    ids = torch.randint(1, 380, (1, 8192), device="cuda")

    def run(offload):
        model.zero_grad(set_to_none=True)
        gc.collect()  # an earlier test's models, freed mid-measurement, would skew `held`
        torch.cuda.synchronize()
        offloader.hooks = None
        hooks = offloader.new_step() if offload else None
        loss = model(input_ids=ids, labels=ids).loss
        torch.cuda.synchronize()
        torch.empty(1, device="cuda")  # let the allocator retire blocks freed on the side stream
        held = torch.cuda.memory_allocated()
        loss.backward()
        grads = {n: p.grad.cpu() for n, p in model.named_parameters()}  # off the GPU: not counted
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads, held, hooks

    # The first run is not the baseline: its backward allocates the autograd thread's cuBLAS
    # workspace (32 MiB on Hopper), which every later run holds between forward and backward.
    _, g_again, _, _ = run(False)
    loss_ref, g_ref, held_ref, _ = run(False)
    loss, g, held, hooks = run(True)
    assert torch.equal(loss, loss_ref)  # the forward is bit-identical
    # Attention and embedding backward accumulate with atomics, so two plain runs already differ
    # slightly (bitwise equality is not on offer); offloading must stay within that run-to-run
    # noise or bf16 rounding of the gradient (1e-2 of its norm), whichever is larger.
    for n in g_ref:
        ref = g_ref[n].float()
        noise = (g_again[n].float() - ref).norm()
        err = (g[n].float() - ref).norm()
        assert err <= max(2 * noise, 1e-2 * ref.norm()), (n, float(err), float(noise))
    # exactly the inputs of the offloaded layers went, nothing else ...
    layer_input = 8192 * 1024 * 2
    assert hooks.offloaded_bytes == (8 - gpu_layers) * layer_input
    # ... and the GPU memory held between forward and backward dropped by what moved
    saved = held_ref - held
    assert 0.97 * hooks.offloaded_bytes <= saved <= 1.03 * hooks.offloaded_bytes, (saved, hooks.offloaded_bytes)
    if prefetch:
        assert hooks.prefetch_hits >= 8 - gpu_layers - 2
    else:
        assert hooks.prefetch_hits == 0   # checkpointing.prefetch false: each copied back on demand
    # in page-locked slabs of exactly their bytes (not torch's power-of-two blocks)
    assert offloader.slabs.registered
    assert offloader.slabs.allocated_bytes == (8 - gpu_layers) * layer_input


def test_tiled_mlp_matches_the_plain_mlp_in_bf16_with_liger(monkeypatch):
    """kernels.tiled_mlp on the GPU path: Liger's SwiGLU run over tiles, under checkpointing."""
    import copy

    from transformers.models.llama import modeling_llama

    from longft.model.patches import apply

    for name in ("LlamaRMSNorm", "LlamaMLP", "apply_rotary_pos_emb"):
        monkeypatch.setattr(modeling_llama, name, getattr(modeling_llama, name))
    ref = _mid_model()
    tiled = copy.deepcopy(ref)
    ids = torch.randint(1, 380, (1, 8192), device="cuda")
    apply(ref, liger=True, checkpointing="gpu")
    record = apply(tiled, liger=True, checkpointing="gpu", tiled_mlp=True, tile_tokens=1024)
    assert record["tiled_mlp_layers"] == 8
    loss_ref, g_ref = _loss_and_grads(ref, ids)
    _, g_again = _loss_and_grads(ref, ids)
    torch.cuda.reset_peak_memory_stats()
    loss, g = _loss_and_grads(tiled, ids)
    torch.testing.assert_close(loss.float(), loss_ref.float(), rtol=1e-2, atol=1e-2)
    for n in g_ref:
        ref_g = g_ref[n].float()
        noise = (g_again[n].float() - ref_g).norm()
        err = (g[n].float() - ref_g).norm()
        assert err <= max(2 * noise, 2e-2 * ref_g.norm()), (n, float(err), float(noise))


def test_keep_attention_skips_the_cudnn_forward_in_backward_with_the_same_grads():
    """checkpointing.keep_attention on the H200 path: cuDNN attention in bf16, 4 of 8 layers keep
    their attention output; their recompute runs no attention kernel, the gradients stay within
    run-to-run noise, and the memory held until backward grows by the kept outputs (plus cuDNN's
    seed/offset tensors and at most one allocator block)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from longft.model import attention
    from longft.model.keep_attention import keep_outputs
    from longft.model.tiled_mlp import decoder_layers

    cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention.default

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += func is cudnn
            return func(*args, **(kwargs or {}))

    model = _mid_model()
    ids = torch.randint(1, 380, (1, 8192), device="cuda")

    def run():
        model.zero_grad(set_to_none=True)
        gc.collect()  # an earlier test's models, freed mid-measurement, would skew `held`
        with attention.context("cudnn"):
            loss = model(input_ids=ids, labels=ids).loss
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated()
            Count.n = 0
            with Count():
                loss.backward()
        return loss.detach(), {n: p.grad.float().cpu() for n, p in model.named_parameters()}, held, Count.n

    loss_ref, g_ref, _, n_ref = run()
    _, g_again, held_ref, _ = run()   # the second run's: lazy workspaces (cuBLAS, cuDNN) exist by then
    assert n_ref == 8  # every layer's recompute ran cuDNN's forward
    assert keep_outputs(decoder_layers(model), 4) == 4
    loss, g, held, n = run()
    assert n == 4
    assert torch.equal(loss, loss_ref)
    for name in g_ref:
        noise = (g_again[name] - g_ref[name]).norm()
        err = (g[name] - g_ref[name]).norm()
        assert err <= max(2 * noise, 1e-2 * g_ref[name].norm()), (name, float(err), float(noise))
    # 4 layers x 8192 tokens x 8 heads x (128 x 2 B output + 4 B fp32 log-sum-exp), plus cuDNN's
    # tiny seed/offset tensors (measured: kept + 4,608 B), and in some runs one more 1 MiB allocator
    # block (measured at 6d93e57 against the first run: kept + 1 MiB + 4,608 B in the suite, + 32 MiB
    # + 4,608 B alone: the first backward's lazy workspaces)
    kept = 4 * 8192 * 8 * (128 * 2 + 4)
    assert kept <= held - held_ref <= kept + (1 << 20) + 4 * 4096, (held - held_ref, kept)


def test_shared_host_grad_buffer_trains_like_the_full_one_on_cuda(tmp_path):
    """zero.host_grad_buffer: shared on the GPU, where the copies into and out of the one staging
    slot are asynchronous (they run in order on DeepSpeed's reduce stream): the same losses as
    DeepSpeed's own per-partition buffer, with the parameters and the optimizer on the CPU."""
    from longft.config.params import Config, merge, to_dict
    from longft.run.pipeline import run_params

    losses = {}
    for mode in ("full", "shared"):
        params = merge(to_dict(Config()),
                       {"data": {"num_samples": 6}, "hardware": {"device": "cuda"},
                        "train": {"global_batch_size": 1, "iterations": 5, "warmup_iterations": 1},
                        "zero": {"offload_param": "cpu", "host_grad_buffer": mode},
                        "output": {"save_checkpoint": False, "export": False}})
        r = run_params(params, tmp_path / mode)
        assert r.failed is None, r.log.read_text()[-3000:]
        rows = [json.loads(x) for x in (r.work / "run/rank0.jsonl").read_text().splitlines()]
        losses[mode] = [x["loss"] for x in rows if x["type"] == "iter"]
        env = next(x for x in rows if x["type"] == "env")
        assert env["host_grad_buffer"] == mode
    assert len(losses["full"]) == 5 and len(set(losses["full"])) == 5
    assert losses["shared"] == pytest.approx(losses["full"], rel=1e-3, abs=1e-4), losses


def _losses_of(params_over: dict, work) -> tuple[list[float], dict]:
    from longft.config.params import Config, merge, to_dict
    from longft.run.pipeline import run_params

    base = {"data": {"num_samples": 6}, "hardware": {"device": "cuda"},
            "train": {"global_batch_size": 1, "iterations": 6, "warmup_iterations": 1},
            # small sub-groups: the tiny model's 141,632 parameters split into 6 of them (with
            # 200,000 they made one, and ratio 0.5 kept int(0.5 x 1) = 0 on the GPU)
            "zero": {"sub_group_size": 20_000},
            "output": {"save_checkpoint": False, "export": False}}
    r = run_params(merge(merge(to_dict(Config()), base), params_over), work)
    assert r.failed is None, r.log.read_text()[-3000:]
    rows = [json.loads(x) for x in (r.work / "run/rank0.jsonl").read_text().splitlines()]
    return [x["loss"] for x in rows if x["type"] == "iter"], next(x for x in rows if x["type"] == "env")


def test_offload_ratio_trains_like_full_offload(tmp_path):
    """zero.offload_ratio 0.5: half the optimizer's sub-groups step on the GPU (torch AdamW), the
    rest with CPU Adam; the losses equal full offload's (the same fp32 Adam), and DeepSpeed really
    put half the sub-groups on the GPU (its own subgroup_to_device, in the env record)."""
    full, env_full = _losses_of({}, tmp_path / "full")
    part, env_part = _losses_of({"zero": {"offload_ratio": 0.5}}, tmp_path / "half")
    assert env_part["offload_ratio"] == 0.5 and env_full["offload_ratio"] == 1.0
    assert len(full) == 6 and len(set(full)) == 6
    assert part == pytest.approx(full, rel=1e-3, abs=1e-4), (full, part)
    # DeepSpeed's own split, as it ran: half of the 6 sub-groups on the GPU, as the estimator says
    assert env_part["optimizer_groups"] == {"gpu": 3, "host": 3}, env_part["optimizer_groups"]
    assert env_full["optimizer_groups"] == {"gpu": 0, "host": 6}, env_full["optimizer_groups"]


@pytest.mark.parametrize("offload_param", ["none", "cpu"])
def test_overlap_step_trains_like_deepspeeds_step_on_cuda(tmp_path, offload_param):
    """zero.overlap_step on: each step's sub-groups update during the next forward, on the GPU
    (parameters on the GPU through the chunked copy back, or on the host): the losses are those
    of DeepSpeed's own step (off), and the plan and the log say which ran."""
    runs = {mode: _losses_of({"zero": {"overlap_step": mode, "offload_param": offload_param}},
                             tmp_path / mode) for mode in ("off", "on")}
    (off, env_off), (on, env_on) = runs["off"], runs["on"]
    assert env_off["overlap_step"] == "off" and env_on["overlap_step"] == "on"
    assert env_on["zero_knobs"]["stage3_param_persistence_threshold"] == 0
    assert len(off) == 6 and len(set(off)) == 6
    assert on == pytest.approx(off, rel=1e-4, abs=1e-5), (off, on)


def test_bf16_optimizer_states_depart_little_from_fp32(tmp_path):
    """zero.optimizer_states bf16 (opt-in): the loss curve stays close to fp32 states' over a short
    run; the departure is printed (bench/LOG.md quotes it) and bounded."""
    fp32, _ = _losses_of({"precision": "bf16"}, tmp_path / "fp32")
    bf16, env = _losses_of({"precision": "bf16", "zero": {"optimizer_states": "bf16"}},
                           tmp_path / "bf16")
    assert env["optimizer_states"] == "bf16"
    dep = max(abs(a - b) / abs(a) for a, b in zip(fp32, bf16))
    print(f"bf16 optimizer states: largest relative loss departure {dep:.4f} over {len(fp32)} steps "
          f"(fp32 {fp32[-1]:.4f}, bf16 {bf16[-1]:.4f} at the last)")
    assert bf16 != fp32          # it really ran in bf16
    assert dep < 0.05, (fp32, bf16)
