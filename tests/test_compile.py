"""``model.compile`` and ``model.fuse`` (``model/compile.py``): the fused and compiled model computes
what the eager one does, in every precision and layout, and its mistakes are one sentence.

Compiling with inductor costs tens of seconds per graph on these CPUs, so the layout and CLI
tests use the ``aot_eager`` backend: dynamo traces the same graphs (``fullgraph=True``: a graph
break is an error) and AOT autograd functionalises them; only inductor's code generation is left
out. One test compiles with inductor here; the GPU tests (``-m gpu``) compile with it everywhere.
"""

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from launching import (
    MAX_QUANTIZED_RELATIVE_ERROR,
    MAX_RELATIVE_ERROR,
    assert_same_latents,
    ditrun_command,
    records,
    relative_error,
    run,
    single_reference,
    tiny_config,
)

from ditrun.config import ModelConfig
from ditrun.errors import UserError
from ditrun.kernels import epilogue
from ditrun.model.build import DeviceDtype, build_model
from ditrun.model.compile import CompilePlan, fuse_epilogues, fuse_projections, plan_compile
from ditrun.model.dit import GeluLinear, JoinedLinear, StackedLinear, gelu_activation, no_activation, sdpa_attention
from ditrun.model.graphs import GraphedForward
from ditrun.model.precision import plan_precision

CPU = DeviceDtype(torch.device("cpu"), torch.float32, "fp32")
DEBUG_BACKEND = ["model.compile=on", "model.compile_backend=aot_eager"]


def _inputs(seed: int = 0, n_img: int = 48, n_txt: int = 12) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(1, n_img, 64, generator=g),
        encoder_hidden_states=torch.randn(1, n_txt, 64, generator=g),
        pooled_projections=torch.randn(1, 32, generator=g),
        timestep=torch.tensor([0.4]),
        img_ids=torch.randint(0, 8, (n_img, 3), generator=g).float(),
        txt_ids=torch.zeros(n_txt, 3),
        guidance=torch.tensor([3.5]),
    )


def _built(precision: str = "bf16", variant: str = "flux", compile_plan=None):
    cfg = tiny_config(f"precision={precision}", f"model.variant={variant}")
    plan = plan_precision(cfg.precision, CPU.device)
    return build_model(cfg.model, CPU, plan, announce=False, compile_plan=compile_plan)


@pytest.mark.parametrize("variant", ["flux", "krea3"])
def test_fused_projections_compute_what_the_separate_linears_do(variant):
    eager, fused = _built(variant=variant), _built(variant=variant)
    stacked = fuse_projections(fused.model)
    geo = fused.model.geometry
    per_single = 4 + (1 if geo.attention_gate else 0)  # q, k, v, (gate), proj_mlp -> one GEMM
    per_double = 2 * (3 + (1 if geo.attention_gate else 0))  # each stream's q, k, v, (gate)
    assert stacked == geo.num_single_layers * per_single + geo.num_layers * per_double
    block = fused.model.single_transformer_blocks[0]
    assert isinstance(block.fused_in, StackedLinear) and block.proj_mlp is None and block.attn.to_q is None
    with torch.no_grad():
        want, got = eager.model(**_inputs()), fused.model(**_inputs())
    assert relative_error(got, want) < MAX_RELATIVE_ERROR


@pytest.mark.parametrize("variant", ["flux", "krea3"])
def test_gelu_epilogues_compute_what_the_unfused_mlps_do(variant):
    """GELU MLPs take their activation into the input projection (``GeluLinear``); a single block's output
    projection reads the attention output and the MLP's hidden state apart (``JoinedLinear``), and its Q, K, V
    are stacked without the MLP projection. SwiGLU MLPs (krea3) keep their activation and the stacked input."""
    eager, fused = _built(variant=variant), _built(variant=variant)
    changed = fuse_epilogues(fused.model)
    stacked = fuse_projections(fused.model)
    geo, single = fused.model.geometry, fused.model.single_transformer_blocks[0]
    if variant == "krea3":
        assert changed == 0 and isinstance(single.fused_in, StackedLinear)
    else:
        assert changed == geo.num_single_layers + 2 * geo.num_layers
        assert stacked == (geo.num_single_layers + 2 * geo.num_layers) * 3  # q, k, v per stream
        assert isinstance(single.proj_mlp, GeluLinear) and isinstance(single.proj_out, JoinedLinear)
        assert single.fused_in is None and isinstance(single.attn.stacked["image"], StackedLinear)
        assert single.activation is no_activation
        ff = fused.model.transformer_blocks[0].ff_context
        assert isinstance(ff.net[0].proj, GeluLinear) and ff.activation is no_activation
    with torch.no_grad():
        want, got = eager.model(**_inputs()), fused.model(**_inputs())
    assert relative_error(got, want) < MAX_RELATIVE_ERROR


def test_epilogue_ops_are_the_linears_they_replace():
    """On the CPU ``linear_gelu`` is the torch reference itself; ``joined_linear`` is the linear of the joined input
    up to fp32 rounding. Both ops' schemas, fake tensors and dynamic shapes pass ``opcheck``."""
    g = torch.Generator().manual_seed(5)
    x, w, b = torch.randn(2, 7, 24, generator=g), torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    assert torch.equal(epilogue.linear_gelu(x, w, b), F.gelu(F.linear(x, w, b), approximate="tanh"))
    hidden, w_out = torch.randn(2, 7, 40, generator=g), torch.randn(24, 64, generator=g)
    want = F.linear(torch.cat([x, hidden], dim=-1), w_out, b[:24])
    got = epilogue.joined_linear(x, hidden, w_out[:, :24].contiguous(), w_out[:, 24:].contiguous(), b[:24])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.library.opcheck(epilogue.linear_gelu, (x, w, b))
    torch.library.opcheck(
        epilogue.joined_linear, (x, hidden, w_out[:, :24].contiguous(), w_out[:, 24:].contiguous(), b[:24])
    )


@pytest.mark.gpu
def test_gpu_epilogue_ops_round_no_worse_than_the_unfused_gemms():
    """BF16 at a Flux MLP's width on fresh random inputs, against the fp32 computation: the GELU applied to the
    GEMM's fp32 accumulator (one rounding) is at least as close as the GEMM, rounded, then the GELU; the joined
    projection's extra rounding of the partial sum stays within two BF16 roundings of the one-GEMM result."""
    g = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(1, 1000, 3072, device="cuda", generator=g).bfloat16()
    w = (torch.randn(12288, 3072, device="cuda", generator=g) / 3072**0.5).bfloat16()
    b = (torch.randn(12288, device="cuda", generator=g) * 0.1).bfloat16()
    exact = F.gelu(F.linear(x.float(), w.float(), b.float()), approximate="tanh")
    fused, unfused = epilogue.linear_gelu(x, w, b), F.gelu(F.linear(x, w, b), approximate="tanh")
    assert relative_error(fused.float(), exact) <= relative_error(unfused.float(), exact)
    w_out = (torch.randn(3072, 3072 + 12288, device="cuda", generator=g) / 15360**0.5).bfloat16()
    exact = F.linear(torch.cat([x, fused], -1).float(), w_out.float(), b[:3072].float())
    one = F.linear(torch.cat([x, fused], -1), w_out, b[:3072])
    two = epilogue.joined_linear(x, fused, w_out[:, :3072].contiguous(), w_out[:, 3072:].contiguous(), b[:3072])
    assert relative_error(two.float(), exact) <= 2.5 * relative_error(one.float(), exact)


@pytest.mark.slow
def test_fusion_leaves_quantized_projections_to_their_own_stack():
    fused = _built("fp8")
    # Q, K, V are one quantized stack already and the MLP is FP8: nothing plain is left to fuse.
    assert fuse_projections(fused.model) == 0
    assert fused.model.single_transformer_blocks[0].fused_in is None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_inductor_compiled_model_equals_eager_whole_blocks_and_halves():
    """The run's attention compiles into each block; any other attention (a layout's, which exchanges)
    runs between the compiled halves. Both equal the eager model."""
    eager = _built()
    compiled = _built(compile_plan=CompilePlan(compile=True, fuse=True))
    # The GELU MLPs (2 single blocks, 2 MLPs in each of 2 double blocks) in their GEMMs' epilogues; then each
    # single block's q, k, v and each double block's streams' q, k, v stacked.
    assert compiled.details["compile"] == {
        "mode": "compiled",
        "gelu_epilogues": 6,
        "fused_linears": 18,
        "compiled_blocks": 4,
    }
    inputs = _inputs()
    with torch.no_grad():
        want = eager.model(**inputs)
        whole = compiled.model(**inputs, attention=compiled.attention)
        halves = compiled.model(**inputs, attention=lambda q, k, v: sdpa_attention(q, k, v))
    assert relative_error(whole, want) < MAX_RELATIVE_ERROR
    assert relative_error(halves, want) < MAX_RELATIVE_ERROR


COMPILED_GRAPHS: list = []


@torch._dynamo.register_backend
def ditrun_test_counting(graph, example_inputs):
    """A torch.compile backend that counts what it is given and runs it eagerly."""
    COMPILED_GRAPHS.append(graph)
    return graph.forward


@pytest.mark.slow
@pytest.mark.parametrize("guarded", [False, True], ids=["plain", "guarded"])
def test_blocks_of_one_class_compile_once(guarded):
    """Every block of a class runs the graph its first block compiled (a backend per block would make Dynamo
    recompile the same code once per block: 57 compilations on FLUX.1-dev, and past the recompile limit, eager)."""
    torch._dynamo.reset()
    COMPILED_GRAPHS.clear()
    guard = (lambda compile_graph: compile_graph()) if guarded else None
    compiled = _built(compile_plan=CompilePlan(compile=True, fuse=True, backend="ditrun_test_counting", guard=guard))
    inputs = _inputs()
    with torch.no_grad():
        compiled.model(**inputs, attention=compiled.attention)
        compiled.model(**inputs, attention=lambda q, k, v: sdpa_attention(q, k, v))
    # 2 double and 2 single blocks: one whole-block graph and two halves per class.
    assert len(compiled.model.transformer_blocks) == len(compiled.model.single_transformer_blocks) == 2
    assert len(COMPILED_GRAPHS) == 2 * 3


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", ["fp8", "krea"])  # krea: MX repack, stacked FP8, INT8-QK attention
def test_quantized_models_trace_as_one_graph_per_half(precision):
    """Quantizers, stacked quantized projections, the dispatch rule and INT8-QK attention all trace
    with ``fullgraph=True`` (a graph break would raise) and compute the eager result."""
    eager = _built(precision)
    compiled = _built(precision, compile_plan=CompilePlan(compile=True, fuse=True, backend="aot_eager"))
    inputs = _inputs(1)
    with torch.no_grad():
        want = eager.model(**inputs, attention=eager.attention)
        whole = compiled.model(**inputs, attention=compiled.attention)
        halves = compiled.model(**inputs, attention=lambda q, k, v: compiled.attention(q, k, v))
    assert relative_error(whole, want) < MAX_RELATIVE_ERROR
    assert relative_error(halves, want) < MAX_RELATIVE_ERROR


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.compile=yes", "model.compile='yes' is unknown; allowed: auto, on, off."),
        ("model.fuse=maybe", "model.fuse='maybe' is unknown; allowed: auto, on, off."),
        ("model.cuda_graphs=always", "model.cuda_graphs='always' is unknown; allowed: auto, on, off."),
        ("model.cuda_graphs=on", "model.cuda_graphs=on needs a GPU, and device is cpu; allowed here: auto, off."),
    ],
)
def test_compile_mistakes_are_one_sentence(override, message):
    with pytest.raises(UserError) as err:
        plan_compile(tiny_config(override).model, CPU.device)
    assert str(err.value) == message


def test_an_unknown_quantizer_is_one_sentence():
    from ditrun.model.precision import plan_precision

    with pytest.raises(UserError) as err:
        plan_precision(tiny_config("precision=fp8", "precision.quantizer=triton").precision, CPU.device)
    assert str(err.value) == "precision.quantizer='triton' is unknown; allowed: compiled, kernel."


def test_an_unknown_compile_backend_is_named():
    with pytest.raises(
        UserError,
        match=r"model.compile_backend='fastest' is not a torch.compile backend here; "
        r"allowed: .*inductor",
    ):
        plan_compile(tiny_config("model.compile=on", "model.compile_backend=fastest").model, CPU.device)


def test_fp8_all_is_the_fast_path_and_tunes_on_gpus_only():
    """The preset names the whole fast configuration: FP8 linears on the fast-accumulation GEMM, cuDNN's FP8
    attention, inductor's tuning and CUDA graphs on GPUs; CPUs compile untuned (nothing of inductor's to tune);
    a key set on the command line still wins over the preset's."""
    cfg = tiny_config("precision=fp8_all")
    assert (cfg.precision.name, cfg.precision.backend, cfg.precision.attention) == (
        "fp8_all",
        "fp8_rowwise_fast",
        "fp8_pv",
    )
    assert plan_compile(cfg.model, torch.device("cuda")).label == "compiled, tuned, CUDA graphs"
    assert not plan_compile(tiny_config("precision=fp8_all", "model.compile=on").model, torch.device("cpu")).tuning
    assert not tiny_config("precision=fp8_all", "model.compile_tuning=false").model.compile_tuning
    assert not tiny_config("precision=fp8").model.compile_tuning


def test_auto_compiles_on_gpus_only():
    model = ModelConfig()
    assert plan_compile(model, torch.device("cpu")) == CompilePlan(compile=False, fuse=False)
    assert plan_compile(model, torch.device("cuda")) == CompilePlan(compile=True, fuse=True, graphs=True)
    assert plan_compile(tiny_config("model.fuse=on").model, torch.device("cpu")) == CompilePlan(False, True)
    tuned = plan_compile(tiny_config("model.compile_tuning=true").model, torch.device("cuda"))
    assert tuned == CompilePlan(True, True, "inductor", tuning=True, graphs=True)
    assert tuned.label == "compiled, tuned, CUDA graphs"
    debug = tiny_config("model.compile=on", "model.compile_tuning=true", "model.compile_backend=aot_eager").model
    assert not plan_compile(debug, torch.device("cpu")).tuning  # inductor's option: nothing to tune in aot_eager
    graphs = tiny_config("model.cuda_graphs=auto").model
    assert plan_compile(graphs, torch.device("cuda")).label == "compiled, CUDA graphs"
    assert not plan_compile(graphs, torch.device("cpu")).graphs
    eager = tiny_config("model.cuda_graphs=auto", "model.compile=off").model
    assert not plan_compile(eager, torch.device("cuda")).graphs


def test_compiled_gelu_is_the_tanh_gelu_written_with_a_sigmoid():
    x = torch.cat([torch.linspace(-12, 12, 4001), torch.randn(4000) * 3, torch.tensor([0.0, -0.0, 80.0, -80.0])])
    traced = torch.compile(gelu_activation, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(traced(x), F.gelu(x, approximate="tanh"), rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(traced(x.bfloat16()), F.gelu(x.bfloat16(), approximate="tanh"))
    assert torch.equal(gelu_activation(x), F.gelu(x, approximate="tanh"))  # eager: diffusers' bits


def test_graphed_forward_runs_cpu_calls_and_exchanging_attention_as_they_are():
    built = _built()
    graphed = GraphedForward(built.model, built.attention)
    inputs = _inputs()
    assert torch.equal(graphed(**inputs, attention=built.attention), built.model(**inputs, attention=built.attention))
    assert torch.equal(graphed(**inputs, attention=lambda q, k, v: sdpa_attention(q, k, v)), built.model(**inputs))
    assert graphed.graphs == {}


@pytest.mark.slow
def test_importing_the_worker_costs_no_dynamo_import():
    """Importing torch._dynamo takes 2.4 s; a process that imports the worker and never compiles (every CPU rank)
    must not pay that, so nothing the kernels define at import time may reach it."""
    imported = subprocess.run(
        [sys.executable, "-c", "import sys, ditrun.run.worker; print('torch._dynamo' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert imported.stdout.strip() == "False", imported.stderr


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_weights_are_to_emptys_without_importing_sympy(dtype):
    """``load.draw_random_weights`` assigns its tensors (as a checkpoint's are): the weights ``Module.to_empty``
    and a copy gave, bit for bit, without torch's Python ``empty_like``, whose first call imports sympy (0.75 s in
    every process that builds a model)."""
    from ditrun.model.dit import FluxDiT
    from ditrun.model.load import random_model
    from ditrun.model.presets import PRESETS

    ours = random_model(PRESETS["tiny"], seed=3, dtype=dtype)
    with torch.device("meta"):
        theirs = FluxDiT(PRESETS["tiny"])
    theirs.to(dtype=dtype).to_empty(device="cpu")
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in sorted(theirs.named_parameters()):
            data = torch.empty(param.shape)
            if name.endswith("norm_q.weight") or name.endswith("norm_k.weight") or ".norm_added_" in name:
                data.uniform_(0.9, 1.1, generator=gen)
            else:
                bound = 1.0 / param.shape[-1] ** 0.5 if param.ndim == 2 else 0.02
                data.uniform_(-bound, bound, generator=gen)
            param.copy_(data)
    expected = dict(theirs.named_parameters())
    for name, param in ours.named_parameters():
        assert param.dtype == dtype and torch.equal(param, expected.pop(name)), name
    assert not expected
    code = (
        "import sys; from ditrun.model.load import random_model; from ditrun.model.presets import PRESETS; "
        "random_model(PRESETS['tiny']); print('sympy' in sys.modules)"
    )
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert imported.stdout.strip() == "False", imported.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cli_compiled_ulysses_on_two_ranks_equals_eager_single(tmp_path):
    """The whole path: the CLI, two spawned ranks, the exchanges between the compiled halves, FP8."""
    reference = single_reference(tmp_path / "single", "precision=fp8", "metrics.report=false")
    out = tmp_path / "run"
    proc = run(
        ditrun_command("precision=fp8", "layout=ulysses", "launcher.world=2", *DEBUG_BACKEND, f"hydra.run.dir={out}"),
        200,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert_same_latents(out, reference, "ulysses", 2, MAX_QUANTIZED_RELATIVE_ERROR)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["precision_detail"]["compile"] == {
        "mode": "compiled (aot_eager)",
        "gelu_epilogues": 0,
        "fused_linears": 0,
        "compiled_blocks": 4,
    }
    assert "warmup_excess_s" in summary and len(records(out)) == 1


GPU = ["device=cuda", "model.dtype=bf16", "metrics.report=false", "workload.limit=2"]


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("precision", ["bf16", "fp8", "krea"])
def test_gpu_compiled_run_matches_the_eager_run(tmp_path, precision):
    from launching import latents

    from ditrun.run import worker

    eager = worker.run(tiny_config(f"precision={precision}", "model.compile=off", *GPU), tmp_path / "eager")
    try:
        compiled = worker.run(tiny_config(f"precision={precision}", *GPU), tmp_path / "compiled")
    finally:  # inductor's pool of compile workers lives as long as this process: end it with the test
        from torch._inductor.async_compile import shutdown_compile_workers

        shutdown_compile_workers()
    assert compiled["precision_detail"]["compile"]["mode"] == "compiled, CUDA graphs"
    assert eager["precision_detail"]["compile"]["mode"] == "eager"
    for record in records(tmp_path / "eager"):
        # BF16 compute: fused kernels round differently; quantized: a rounding flip moves a code.
        edit = record["edit"]
        assert relative_error(latents(tmp_path / "compiled", edit), latents(tmp_path / "eager", edit)) < 2e-2


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_gpu_kernel_quantizer_runs_in_the_compiled_blocks_and_matches_the_compiled_quantizer(tmp_path, monkeypatch):
    """``precision.quantizer=kernel``: the compiled blocks' FP8 down projections (a double block's MLP, a single
    block's [attention | MLP] output projection) quantize through ditrun's Triton kernel, with the activation and
    the prefix inside it (its calls counted), and the latents match ``quantizer=compiled``'s run (the same codes
    but for the activation's fp32 rounding: Inductor may keep the GELU in fp32 where the kernel rounds it)."""
    from launching import latents

    from ditrun.kernels import quantize_triton
    from ditrun.run import worker

    calls, original = [], quantize_triton.rowwise_fp8

    def counted(x, dtype, *args, **kwargs):
        calls.append((kwargs.get("activation"), kwargs.get("prefix") is not None))
        return original(x, dtype, *args, **kwargs)

    monkeypatch.setattr(quantize_triton, "rowwise_fp8", counted)
    run = ["model=flux-dev", "model.num_layers=1", "model.num_single_layers=1", "precision=fp8_all",
           "workload.width=128", "workload.height=128", *GPU]  # fmt: skip
    try:
        worker.run(tiny_config(*run), tmp_path / "compiled")
        traced = list(calls)
        summary = worker.run(tiny_config(*run, "precision.quantizer=kernel"), tmp_path / "kernel")
    finally:
        from torch._inductor.async_compile import shutdown_compile_workers

        shutdown_compile_workers()
    assert summary["precision_detail"]["quantizer"] == "kernel"
    assert not any(activation or prefix for activation, prefix in traced)
    assert {("gelu_tanh", False), ("gelu_tanh", True)} <= set(calls[len(traced) :])
    for record in records(tmp_path / "compiled"):
        edit = record["edit"]
        assert relative_error(latents(tmp_path / "kernel", edit), latents(tmp_path / "compiled", edit)) < 2e-2


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_gpu_compiled_fp8_product_attention_matches_the_eager_run(tmp_path):
    """``int8qk_fp8v`` on the Hopper Gluon kernel, whose P @ V is an FP8 product: V's codes written by the
    quantization inside the compiled blocks (fullgraph) and the op taking them, replayed from CUDA graphs, against
    the same run eager. The FLUX.1-dev head (128 channels, the Gluon kernel's) in one block of each kind, 8 heads;
    128 x 128 images: enough tokens for the Hopper kernel."""
    from launching import latents

    from ditrun.run import worker

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the FP8 P @ V is the Hopper (sm_90) Gluon kernel's")
    run = [
        "model=flux-dev",
        "model.num_layers=1",
        "model.num_single_layers=1",
        "precision=bf16",
        "precision.attention=int8qk_fp8v",
        "workload.width=128",
        "workload.height=128",
        *GPU,
    ]
    worker.run(tiny_config(*run, "model.compile=off"), tmp_path / "eager")
    try:
        compiled = worker.run(tiny_config(*run), tmp_path / "compiled")
    finally:
        from torch._inductor.async_compile import shutdown_compile_workers

        shutdown_compile_workers()
    assert compiled["precision_detail"]["compile"]["mode"] == "compiled, CUDA graphs"
    assert compiled["precision_detail"]["attention"]["backends"] == ["gluon"]
    for record in records(tmp_path / "eager"):
        edit = record["edit"]
        assert relative_error(latents(tmp_path / "compiled", edit), latents(tmp_path / "eager", edit)) < 2e-2


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_gpu_int8qk_attention_at_a_sequence_off_the_key_scales_tma_boundary_through_the_cli(tmp_path):
    """``int8qk_fp8v`` on the Hopper Gluon kernel through the command, 135 tokens (7 text, 64 output, 64 reference)
    and 8 heads: each head's key scales start off a 16-byte boundary unless the kernel pads them
    (``attention_gluon._key_scales``), and a TMA load from there is an illegal instruction. The run ends with its
    edits."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the INT8-QK Gluon kernel is the Hopper (sm_90) one")
    proc = run(
        ditrun_command(
            "model=flux-dev",
            "model.num_layers=1",
            "model.num_single_layers=1",
            "precision=bf16",
            "precision.attention=int8qk_fp8v",
            "workload.width=128",
            "workload.height=128",
            "model.compile=off",
            *GPU,
            f"hydra.run.dir={tmp_path / 'run'}",
        ),
        timeout=280,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["complete"] and summary["precision_detail"]["attention"]["backends"] == ["gluon"]


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_gpu_graphed_forward_replays_the_compiled_forward(monkeypatch):
    """One graph per input shape; a replay computes the new inputs' result, as the compiled model does; past
    ``MAX_GRAPHS`` shapes the model runs as it is."""
    from ditrun.model import graphs

    monkeypatch.setattr(graphs, "MAX_GRAPHS", 2)
    cuda = DeviceDtype(torch.device("cuda"), torch.bfloat16, "bf16")
    cfg = tiny_config("precision=fp8")
    built = build_model(
        cfg.model,
        cuda,
        plan_precision(cfg.precision, cuda.device),
        announce=False,
        compile_plan=CompilePlan(compile=True, fuse=True, graphs=True),
    )
    assert isinstance(built.forward, GraphedForward)
    with torch.inference_mode():
        for seed, n_img in ((0, 48), (1, 48), (2, 80), (3, 96)):
            inputs = {k: v.to("cuda") for k, v in _inputs(seed, n_img).items()}
            for k in ("hidden_states", "encoder_hidden_states", "pooled_projections"):
                inputs[k] = inputs[k].bfloat16()
            got = built.forward(**inputs, attention=built.attention)
            want = built.model(**inputs, attention=built.attention)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert len(built.forward.graphs) == 2 and not built.forward.failed
