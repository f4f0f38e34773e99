"""cookbook.integrations: patched tiny models give the unpatched models' answers, and bad uses fail clearly.

Tiny randomly initialized models built from configs (no downloads), with random q/k norm
weights so that a wrong weight or weight offset shows. On a CPU `backend="auto"` is the PyTorch
reference, which follows each model's rounding order exactly: the logits must be bit-identical
(`compare`: the op contracts' rule). FLUX's rounding order is not one the fused op has, so its
output is judged by accuracy against a float32 run of the same weights (`output_parity`).
Negative controls show each check failing on a deliberately wrong patch.
"""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")

from cookbook import integrations  # noqa: E402
from cookbook.integrations import LayoutError, bench, compare, output_parity  # noqa: E402
from cookbook.integrations import transformers as fused_lm  # noqa: E402

FAMILIES = ("qwen3", "qwen3_moe", "gemma3", "olmo2")
EXPECTED_OPS = {"qwen3": "qk_norm_rope", "qwen3_moe": "qk_norm_rope", "gemma3": "qk_norm", "olmo2": "cross_head_norm"}
BATCH, TOKENS = 2, 12


def tiny_lm(family, dtype=torch.bfloat16, seed=0):
    return bench.causal_lm(family, bench.TINY_LM_DIMS, dtype=dtype, seed=seed)


def prompt(model, seed=0):
    """A batch of two sequences, the second left-padded by a quarter."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, model.config.vocab_size, (BATCH, TOKENS), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, : TOKENS // 4] = 0
    return ids, mask


def logits(model, ids, mask):
    with torch.inference_mode():
        return model(ids, attention_mask=mask).logits[mask.bool()]


def greedy(model, ids, mask, **kwargs):
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False, **kwargs)
    return out[:, ids.shape[1]:]


def float32_logits(model, ids, mask):
    return logits(copy.deepcopy(model).float(), ids, mask)


# --------------------------------------------------------------------------------------------
# Parity.
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_logits_match(family, dtype):
    model = tiny_lm(family, dtype)
    ids, mask = prompt(model)
    before = logits(model, ids, mask)
    report = fused_lm.patch(model)
    after = logits(model, ids, mask)
    assert {m.op for m in report.patched} == {EXPECTED_OPS[family]}
    result = compare(after, before)
    assert result.ok, f"{family} {dtype}: patched logits differ from the model's: {result}"


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_same_tokens(family):
    model = tiny_lm(family)
    ids, mask = prompt(model, seed=1)
    before = greedy(model, ids, mask)
    fused_lm.patch(model)
    assert torch.equal(greedy(model, ids, mask), before)


@pytest.mark.parametrize("family", FAMILIES)
def test_static_cache_generation_same_tokens(family):
    """Another cache layout (a preallocated static cache written at cache positions)."""
    model = tiny_lm(family)
    ids, mask = prompt(model, seed=2)
    before = greedy(model, ids, mask, cache_implementation="static")
    fused_lm.patch(model)
    assert torch.equal(greedy(model, ids, mask, cache_implementation="static"), before)


def test_patched_model_is_as_accurate_as_the_model():
    """The accuracy rule the FLUX test and the GPU bench use, on an LM: it passes here (bit-identical)."""
    model = tiny_lm("qwen3")
    ids, mask = prompt(model)
    exact, before = float32_logits(model, ids, mask), logits(model, ids, mask)
    fused_lm.patch(model)
    parity = output_parity(logits(model, ids, mask), before, exact)
    assert parity.ok and parity.identical_share == 1.0, str(parity)


def test_torch_compile_traces_the_fused_op():
    """Dynamo traces the patched forward in one graph (fullgraph) with the custom op inside; the
    aot_eager backend runs it through functionalization (the in-place writes) without a C++ build."""
    model = tiny_lm("qwen3")
    ids, mask = prompt(model)
    fused_lm.patch(model)
    eager = logits(model, ids, mask)
    traced_ops = []

    def record_then_aot_eager(graph_module, example_inputs):
        traced_ops.extend(str(node.target) for node in graph_module.graph.nodes if node.op == "call_function")
        from torch._dynamo.backends.common import aot_autograd
        from functorch.compile import make_boxed_func

        return aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward))(graph_module, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=record_then_aot_eager, fullgraph=True)
    with torch.inference_mode():
        out = compiled(ids, attention_mask=mask).logits[mask.bool()]
    torch._dynamo.reset()
    assert sum("cookbook.qk_norm_rope" in op for op in traced_ops) == bench.TINY_LM_DIMS.layers
    assert torch.equal(out, eager)


def test_unpatch_restores_the_original_forwards():
    model = tiny_lm("gemma3")
    ids, mask = prompt(model)
    before = logits(model, ids, mask)
    patched_report = fused_lm.patch(model)
    assert fused_lm.unpatch(model) == patched_report
    for module in model.modules():
        assert "forward" not in module.__dict__
    assert torch.equal(logits(model, ids, mask), before)
    fused_lm.patch(model)  # patchable again


def test_report_names_what_was_patched_and_left_alone():
    qwen, llama = tiny_lm("qwen3"), _llama()
    report = fused_lm.patch(torch.nn.ModuleDict({"qwen": qwen, "llama": llama}))
    assert [m.name for m in report.patched] == ["qwen.model.layers.0.self_attn", "qwen.model.layers.1.self_attn"]
    assert {(m.cls, m.op, m.rounding, m.weight_offset, m.fused_rope) for m in report.patched} == {
        ("Qwen3Attention", "qk_norm_rope", "hf", 0.0, True)}
    assert [(m.cls, m.reason) for m in report.skipped] == [("LlamaAttention", "no q/k norm to fuse")] * 2
    text = str(report)
    assert "2 x Qwen3Attention -> cookbook.qk_norm_rope(rounding='hf'" in text and "left alone: 2 x LlamaAttention" in text


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    dims = bench.TINY_LM_DIMS
    return LlamaForCausalLM(LlamaConfig(vocab_size=dims.vocab, hidden_size=dims.hidden, intermediate_size=dims.intermediate,
                                        num_hidden_layers=dims.layers, num_attention_heads=dims.heads,
                                        num_key_value_heads=dims.kv_heads, head_dim=dims.head_dim)).eval()


# --------------------------------------------------------------------------------------------
# Negative controls: a wrong patch is caught.
# --------------------------------------------------------------------------------------------
WRONG_SPECS = {
    "qwen3 with fused rounding": ("qwen3", "Qwen3Attention", dict(rounding="fused")),
    "gemma3 without its 1 + w": ("gemma3", "Gemma3Attention", dict(weight_offset=0.0)),
    "gemma3 with hf rounding": ("gemma3", "Gemma3Attention", dict(rounding="hf")),
    "olmo2 with hf rounding": ("olmo2", "Olmo2Attention", dict(rounding="hf")),
}


@pytest.mark.parametrize("case", WRONG_SPECS)
def test_patch_time_check_refuses_a_wrong_spec(case, monkeypatch):
    family, cls, change = WRONG_SPECS[case]
    monkeypatch.setitem(fused_lm.SPECS, cls, dataclasses.replace(fused_lm.SPECS[cls], **change))
    model = tiny_lm(family)
    with pytest.raises(LayoutError, match=f"{cls}: cookbook.* does not reproduce the model's own q norm"):
        fused_lm.patch(model)
    assert all("forward" not in m.__dict__ for m in model.modules()), "a refused patch must change nothing"


@pytest.mark.parametrize("case", WRONG_SPECS)
def test_logit_check_detects_a_wrong_spec(case, monkeypatch):
    """With the patch-time check switched off, the logits comparison itself catches the wrong patch."""
    family, cls, change = WRONG_SPECS[case]
    monkeypatch.setitem(fused_lm.SPECS, cls, dataclasses.replace(fused_lm.SPECS[cls], **change))
    monkeypatch.setattr(fused_lm, "probe", lambda *args, **kwargs: None)
    model = tiny_lm(family)
    ids, mask = prompt(model)
    before = logits(model, ids, mask)
    fused_lm.patch(model)
    assert not compare(logits(model, ids, mask), before).ok


# --------------------------------------------------------------------------------------------
# Bad uses.
# --------------------------------------------------------------------------------------------
def test_model_without_supported_attention():
    with pytest.raises(ValueError, match=r"model: no supported attention module in LlamaForCausalLM .*no q/k norm to fuse.*supported: Qwen3Attention"):
        fused_lm.patch(_llama())


def test_patching_twice():
    model = tiny_lm("olmo2")
    fused_lm.patch(model)
    with pytest.raises(RuntimeError, match="model: Olmo2ForCausalLM is already patched.*call unpatch"):
        fused_lm.patch(model)
    with pytest.raises(RuntimeError, match=r"submodule self_attn \(Olmo2Attention\) is already patched"):
        fused_lm.patch(model.model.layers[0])  # a submodule of a patched model


def test_unpatch_of_an_unpatched_model():
    with pytest.raises(RuntimeError, match="model: Qwen3ForCausalLM is not patched.*nothing to unpatch"):
        fused_lm.unpatch(tiny_lm("qwen3"))


def test_not_a_model():
    with pytest.raises(TypeError, match="model: expected a loaded transformers model .*got str"):
        fused_lm.patch("Qwen/Qwen3-8B")


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend: expected one of"):
        fused_lm.patch(tiny_lm("qwen3"), backend="triton")


def test_training_mode_is_refused():
    model = tiny_lm("qwen3", torch.float32)
    fused_lm.patch(model)
    ids, mask = prompt(model)
    with pytest.raises(RuntimeError, match="writes q and k in place and has no backward.*inference_mode"):
        model(ids, attention_mask=mask)


def test_unknown_attention_layout():
    """A class the table names whose forward no longer calls the names the patch rebinds."""

    class Qwen3Attention(torch.nn.Module):  # noqa: N801 (the name is what the table matches)
        head_dim = 8

        def __init__(self):
            super().__init__()
            from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

            self.q_norm, self.k_norm = Qwen3RMSNorm(8), Qwen3RMSNorm(8)

        def forward(self, q, k):
            return self.q_norm(q), self.k_norm(k)

    with pytest.raises(LayoutError, match="Qwen3Attention.forward in transformers .* does not call apply_rotary_pos_emb"):
        fused_lm.patch(torch.nn.Sequential(Qwen3Attention()))


def test_replaced_forward_is_refused():
    """An attention whose forward was already replaced (a hook, another patch) is not silently dropped."""
    model = tiny_lm("qwen3")
    attn = model.model.layers[1].self_attn
    attn.forward = attn.forward  # an instance attribute, as accelerate's hooks set
    with pytest.raises(LayoutError, match="model.layers.1.self_attn .*class's own forward"):
        fused_lm.patch(model)


# --------------------------------------------------------------------------------------------
# diffusers: FLUX.
# --------------------------------------------------------------------------------------------
def flux_case(dtype=torch.bfloat16, image_side=4, text_tokens=5):
    pytest.importorskip("diffusers", reason="diffusers is not installed (pip install -e '.[integrations]')", exc_type=ImportError)
    model = bench.flux_transformer(bench.TINY_FLUX_DIMS, dtype=dtype)
    return model, bench.flux_inputs(bench.TINY_FLUX_DIMS, image_side, text_tokens, batch=BATCH, dtype=dtype)


def flux_output(model, inputs):
    with torch.inference_mode():
        return model(**inputs).sample


def flux_float32_output(model, inputs):
    return flux_output(copy.deepcopy(model).float(), {n: t.float() for n, t in inputs.items()})


def test_flux_patched_output_is_as_accurate():
    from cookbook.integrations import diffusers as fused_flux

    model, inputs = flux_case()
    exact, before = flux_float32_output(model, inputs), flux_output(model, inputs)
    report = fused_flux.patch(model)
    assert [(m.name, m.op, m.rounding) for m in report.patched] == [
        ("transformer_blocks.0.attn", "qk_norm_rope", "fused"), ("single_transformer_blocks.0.attn", "qk_norm_rope", "fused")]
    parity = output_parity(flux_output(model, inputs), before, exact)
    assert parity.ok, str(parity)
    fused_flux.unpatch(model)
    assert torch.equal(flux_output(model, inputs), before)


def test_flux_float32_matches():
    """In float32 the rounding orders coincide: the patched transformer reproduces the model."""
    from cookbook.integrations import diffusers as fused_flux

    model, inputs = flux_case(torch.float32)
    before = flux_output(model, inputs)
    fused_flux.patch(model)
    after = flux_output(model, inputs)
    assert (after - before).abs().max().item() <= 1e-5 * before.abs().max().item()


def test_flux_wrong_image_offset_is_detected(monkeypatch):
    """Negative control: image tokens rotated from cache row 0 instead of row text_len."""
    from cookbook.integrations import diffusers as fused_flux

    model, inputs = flux_case()
    exact, before = flux_float32_output(model, inputs), flux_output(model, inputs)
    original = fused_flux.FusedFluxAttnProcessor.norm_and_rope
    monkeypatch.setattr(fused_flux.FusedFluxAttnProcessor, "norm_and_rope",
                        lambda self, q, k, qn, kn, cache, offset: original(self, q, k, qn, kn, cache, 0))
    with pytest.raises(LayoutError, match="not within 3.0 ulp"):
        fused_flux.patch(model)  # the patch-time check sees it first
    monkeypatch.setattr(fused_flux, "probe", lambda *args, **kwargs: None)
    fused_flux.patch(model)
    assert not output_parity(flux_output(model, inputs), before, exact).ok  # and so does the output check


def test_flux_section_check_refuses_a_wrong_rope(monkeypatch):
    """Negative control of the patch-time check: NeoX pairs where FLUX pairs neighbours."""
    from cookbook.integrations import diffusers as fused_flux

    model, _ = flux_case()
    real_op = fused_flux.cookbook.qk_norm_rope
    monkeypatch.setattr(fused_flux.cookbook, "qk_norm_rope", lambda *a, **kw: real_op(*a, **{**kw, "is_neox": True}))
    with pytest.raises(LayoutError, match="not within 3.0 ulp of the model's own q norm and rope"):
        fused_flux.patch(model)


def test_flux_bad_uses():
    from cookbook.integrations import diffusers as fused_flux

    model, _ = flux_case()
    with pytest.raises(RuntimeError, match="is not patched.*nothing to unpatch"):
        fused_flux.unpatch(model)
    fused_flux.patch(model)
    with pytest.raises(RuntimeError, match="already patched"):
        fused_flux.patch(model)
    with pytest.raises(ValueError, match="no FLUX attention with FluxAttnProcessor"):
        fused_flux.patch(tiny_lm("qwen3"))
    with pytest.raises(TypeError, match="model: expected a FluxPipeline or a FluxTransformer2DModel"):
        fused_flux.patch(42)


def test_flux_pipeline_like_object():
    """patch(pipe) patches pipe.transformer."""
    from cookbook.integrations import diffusers as fused_flux

    model, _ = flux_case()
    pipe = type("Pipe", (), {"transformer": model})()
    assert len(fused_flux.patch(pipe).patched) == 2
    fused_flux.unpatch(pipe)


# --------------------------------------------------------------------------------------------
# The shared pieces.
# --------------------------------------------------------------------------------------------
def test_compare_counts_ulps_at_the_rms_scale():
    expected = torch.tensor([1.0, -1.0, 1e-3, 1.0], dtype=torch.bfloat16)
    one_ulp_off = expected.clone()
    one_ulp_off[2] += 2**-7  # 1 ulp of the rms (about 0.87 -> binade of 0.5: ulp 2^-8) ~ 2 ulp
    result = compare(one_ulp_off, expected)
    assert result.exact_share == 0.75 and 1.0 <= result.max_ulp <= 2.0
    assert compare(expected, expected).ok


def test_bench_smoke_on_tiny_dims(tmp_path):
    """The bench's CPU path (parity, no timing) runs and writes its two files."""
    families = ["qwen3"]
    report = bench.run(True, families, tmp_path, "pytest", check_compile=False)
    assert bench.all_ok(report)
    stem = bench.results_stem(report)
    text = (tmp_path / f"{stem}.md").read_text()
    assert "| qwen3 | ok:" in text and (tmp_path / f"{stem}.json").exists()
    if not torch.cuda.is_available():
        assert "timing needs CUDA" in text


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_bench_calls_repeat(family):
    """The bench times a captured decode call over and over: each repetition must compute the
    same thing (the KV cache's counters are put back), patched or not."""
    model = tiny_lm(family)
    attn = bench.timed_layer(model).self_attn
    ids, mask = prompt(model)
    with torch.inference_mode():
        calls = bench.capture_calls({"attn": attn}, lambda: model.generate(
            ids, attention_mask=mask, max_new_tokens=2, min_new_tokens=2, do_sample=False, cache_implementation="static"))
        decode = calls["attn"][1]
        assert decode.kwargs["hidden_states"].shape[1] == 1
        first = decode()[0]
        assert all(torch.equal(decode()[0], first) for _ in range(3))
        fused_lm.patch(model)
        assert all(torch.equal(decode()[0], first) for _ in range(3))


# --------------------------------------------------------------------------------------------
# On a GPU: the CUDA C kernels inside the models (the bench repeats this at real sizes).
# --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_patched_model(family):
    model = bench.causal_lm(family, bench.TINY_LM_DIMS, device="cuda")
    section = bench.lm_section_parity(model, family)
    assert section["ok"], section["detail"]
    result = bench.lm_parity(model, family, fused_lm.patch, fused_lm.unpatch)
    assert result["logits"]["ok"], result["logits"]["detail"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_cuda_graph_of_a_patched_decode_step():
    model = bench.causal_lm("qwen3", bench.TINY_LM_DIMS, device="cuda")
    ids, mask = (t.cuda() for t in prompt(model))
    attn = model.model.layers[0].self_attn
    with torch.inference_mode():
        decode = bench.capture_calls({"attn": attn}, lambda: model.generate(
            ids, attention_mask=mask, max_new_tokens=2, min_new_tokens=2, do_sample=False,
            cache_implementation="static"))["attn"][1]
        fused_lm.patch(model)
        eager = decode()[0].clone()
        captured = {}

        def step():
            captured["out"] = decode()[0]  # during capture: the graph's output tensor

        graph, why_not = bench.graph_of(step)
        assert graph is not None, why_not
        captured["out"].zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured["out"], eager)


def test_public_names():
    assert set(integrations.__all__) <= set(dir(integrations))


class _StaticLayer:
    """A cache layer whose fill counter starts on the CPU and is replaced on first use, as
    transformers' static cache layers move theirs to the keys' device at lazy initialization."""

    def __init__(self):
        self.cumulative_length = torch.tensor(0)


class _FakeCache:
    def __init__(self):
        self.layers = [_StaticLayer()]


class _CounterOnAnotherDevice:
    """Stands for the counter after it moved to the GPU: copy_ refuses a value from elsewhere, as
    a copy from the CPU is refused inside a CUDA graph capture."""

    device = torch.device("meta")

    def copy_(self, value):
        assert value.device == self.device, f"copy from {value.device} into a counter on {self.device}"
        self.value = value


def test_cache_restorer_follows_a_counter_that_moved_device():
    cache = _FakeCache()
    restore = bench.cache_restorer({"past_key_values": cache})  # saved while the counter is on the CPU
    moved = _CounterOnAnotherDevice()
    cache.layers[0].cumulative_length = moved  # the prefill call initialized the cache
    restore()
    assert moved.value.device == moved.device
    restore()  # the moved value is kept: no copy between devices again (a graph capture)
    assert moved.value.device == moved.device


def test_a_call_that_does_not_repeat_is_reported_not_timed():
    class Drifting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return x + self.calls

    module = Drifting()
    call = bench.Call(module, (torch.zeros(3),), {}, lambda: None)
    rows = bench.time_modules(None, {"attention block": module}, {"attention block": call},
                              patch=None, unpatch=None, backend="auto")
    assert rows == [{"module": "attention block", "not_repeatable": rows[0]["not_repeatable"]}]
    assert "max |difference| 1" in rows[0]["not_repeatable"]
    row = {"family": "fake", "size": "decode", "tokens": "1 x 1", **rows[0]}
    assert "not timed: two calls" in bench.row_text(row)
    assert not bench.all_ok({"errors": {}, "parity": {}, "timing": [row]})


def test_patch_builds_every_kernel_it_calls_at_once(monkeypatch):
    """patch builds the kernels of every op its modules call in one parallel build (the first
    forward then waits for none), and names a build that failed."""
    from types import SimpleNamespace

    from cookbook import cuda, registry
    from cookbook.integrations import prepare_backend

    builds = []
    monkeypatch.setattr(registry, "resolve", lambda op, backend, device: SimpleNamespace(extension=f"{op}_tuned"))
    monkeypatch.setattr(cuda, "build", lambda extensions: builds.append(list(extensions)) or {})
    prepare_backend("cuda", "cuda", ["qk_norm_rope", "qk_norm", "qk_norm_rope"])
    assert builds == [["qk_norm_rope_tuned", "qk_norm_tuned"]]

    monkeypatch.setattr(cuda, "build", lambda extensions: {"qk_norm_tuned": RuntimeError("nvcc: error")})
    with pytest.raises(RuntimeError, match="backend='cuda': building qk_norm_tuned failed: .*nvcc: error"):
        prepare_backend("cuda", "cuda", ["qk_norm"])
    with pytest.raises(ValueError, match="backend: expected one of"):
        prepare_backend("triton", "cuda", ["qk_norm"])
