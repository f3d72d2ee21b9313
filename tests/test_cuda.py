"""CUDA: each layer of the library on a GPU against the same computation on the CPU.

Values are compared in float64 (the two devices then agree to rounding; in float32 cuDNN's TF32
convolutions alone move the last digits), except where half precision itself is under test.
Skipped where torch sees no CUDA device: run ``python -m pytest tests/test_cuda.py`` on a GPU
machine (the whole suite there runs these too).
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F

from quotient_manifolds import adapters
from quotient_manifolds.adapters import GeodesicSAM
from quotient_manifolds import GLQuotient, GLQuotientGeometry, RescalingGeometry

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")
F64 = torch.float64


def rel(a, b) -> float:
    a, b = (torch.as_tensor(t).detach().double().cpu() for t in (a, b))
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def on_both(model: torch.nn.Module):
    """(CPU float64 model, CUDA float64 copy)."""
    cpu = copy.deepcopy(model).to(F64)
    return cpu, copy.deepcopy(cpu).to(CUDA)


# ------------------------------------------------------------------------------------ geometry core
@pytest.mark.parametrize("h", [8, 64])
def test_batched_eigh_of_heads_on_the_device(h, monkeypatch):
    """batched_eigh: batches of matrices above 32 × 32 go through the CPU (torch loops over them
    on the device), smaller ones stay on the device; either way eigenpairs on the device, and the
    inv projection (the pencil's eigendecomposition) equal to the CPU's."""
    from quotient_manifolds.core import groups

    g = torch.Generator().manual_seed(1)
    a = torch.randn(12, h, h, generator=g, dtype=F64)
    a = (a + a.mT).to(CUDA)
    moved = []
    real_cpu = torch.Tensor.cpu

    def counted(t, *args, **kwargs):
        moved.append(tuple(t.shape))
        return real_cpu(t, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", counted)
    d, U = groups.batched_eigh(a)
    monkeypatch.undo()
    assert d.device.type == U.device.type == CUDA.type
    assert (tuple(a.shape) in moved) == (h > groups.CUDA_BATCHED_EIGH_MAX)
    assert rel(U @ torch.diag_embed(d) @ U.mT, a) < 1e-12
    assert rel(U.mT @ U, torch.eye(h, dtype=F64).expand(12, h, h)) < 1e-12
    geom = GLQuotientGeometry(2 * h, 2 * h, h, "inv")
    x = geom.random_point(6, dtype=F64, generator=g)
    u = torch.randn(x.shape, generator=g, dtype=F64)
    assert rel(geom.frame(x.to(CUDA)).project(u.to(CUDA)), geom.frame(x).project(u)) < 1e-10


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_gl_core_matches_cpu(metric):
    """Projection, metric, gradient conversion, Γ and all three retractions, batched over heads."""
    geom = GLQuotientGeometry(12, 10, 3, metric)
    g = torch.Generator().manual_seed(0)
    x = geom.random_point(5, dtype=F64, generator=g)
    u, v = (torch.randn(x.shape, generator=g, dtype=F64) for _ in range(2))
    cpu = geom.frame(x)
    gpu = geom.frame(x.to(CUDA))
    xi = 0.05 * cpu.project(u) / cpu.norm(cpu.project(u), keepdim=True)
    pairs = {
        "project": (cpu.project(u), gpu.project(u.to(CUDA))),
        "inner": (cpu.inner(u, v), gpu.inner(u.to(CUDA), v.to(CUDA))),
        "egrad2rgrad": (cpu.egrad2rgrad(u), gpu.egrad2rgrad(u.to(CUDA))),
        "christoffel": (cpu.christoffel(xi), gpu.christoffel(xi.to(CUDA))),
    }
    for method in ("first_order", "second_order", "exact"):
        pairs[method] = (cpu.retract(xi, method), gpu.retract(xi.to(CUDA), method))
    for name, (a, b) in pairs.items():
        assert b.device.type == CUDA.type, name
        assert rel(b, a) < 1e-10, (name, rel(b, a))


def test_rescaling_core_matches_cpu():
    geom = RescalingGeometry(7, "mix")
    g = torch.Generator().manual_seed(1)
    x = torch.rand(4, 2, 7, generator=g, dtype=F64) + 0.5   # rows u and v of the d = 7 net
    u = 0.1 * torch.randn(4, 2, 7, generator=g, dtype=F64)
    cpu, gpu = geom.frame(x), geom.frame(x.to(CUDA))
    xi = cpu.project(u)
    assert rel(gpu.project(u.to(CUDA)), xi) < 1e-12
    for method in ("second_order", "exact"):
        assert rel(gpu.retract(xi.to(CUDA), method), cpu.retract(xi, method)) < 1e-10, method


def test_geoopt_face_riemannian_adam_step_matches_cpu():
    """The geoopt face as a user drives it: a ManifoldParameter on the GPU trained by
    geoopt's RiemannianAdam."""
    geoopt = pytest.importorskip("geoopt")
    manifold = GLQuotient(8, 8, 2, "mix")
    g = torch.Generator().manual_seed(2)
    x0 = GLQuotientGeometry(8, 8, 2, "mix").random_point(3, dtype=F64, generator=g)
    target = torch.randn(x0.shape, generator=g, dtype=F64)
    out = []
    for device in ("cpu", CUDA):
        p = geoopt.ManifoldParameter(x0.clone().to(device), manifold=manifold)
        opt = geoopt.optim.RiemannianAdam([p], lr=1e-2)
        for _ in range(5):
            opt.zero_grad()
            ((p - target.to(device)) ** 2).sum().backward()
            opt.step()
        out.append(p.detach())
    assert out[1].device.type == CUDA.type and rel(out[1], out[0]) < 1e-10


# ------------------------------------------------------------------------------------ sharpness
@pytest.mark.parametrize("geometry", ["adaptive", "geodesic-inv", "geodesic-mix"])
def test_sharpness_matches_cpu_on_hugging_face_bert(tiny_bert, geometry):
    model, inputs = tiny_bert
    cpu, gpu = on_both(model)
    labels = torch.tensor([0, 1])
    batches = [(inputs, labels)]
    a = adapters.sharpness(cpu, batches, geometry=geometry, rho=0.3, n_iters=6)
    b = adapters.sharpness(gpu, batches, geometry=geometry, rho=0.3, n_iters=6)  # CPU batches moved
    assert b.value > 0 and math.isclose(b.value, a.value, rel_tol=1e-7), (a.value, b.value)
    assert next(gpu.parameters()).device.type == CUDA.type


def test_exact_retraction_sharpness_matches_cpu(plain_vit):
    model, x = plain_vit
    cpu, gpu = on_both(model)
    y = torch.tensor([0, 2])
    for geometry in ("geodesic-inv", "geodesic-mix"):
        # two iterations: the exact geodesic's many small steps took 16 s at four on an H200
        a = adapters.sharpness(cpu, [(x.to(F64), y)], geometry=geometry, rho=0.05, n_iters=2,
                               retraction="exact")
        b = adapters.sharpness(gpu, [(x.to(F64).to(CUDA), y.to(CUDA))], geometry=geometry,
                               rho=0.05, n_iters=2, retraction="exact")
        assert math.isclose(b.value, a.value, rel_tol=1e-7), (geometry, a.value, b.value)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_model_on_cuda(tiny_bert, dtype):
    """A half-precision model on the GPU is measured at its weights in float32 (as on the CPU):
    the same value as a float32 copy of the same rounded weights, and the model is unchanged."""
    model, inputs = tiny_bert
    half = copy.deepcopy(model).to(dtype).to(CUDA)
    before = {n: p.detach().clone() for n, p in half.named_parameters()}
    f32 = copy.deepcopy(half).float()
    batches = [(inputs, torch.tensor([0, 1]))]
    a = adapters.sharpness(f32, batches, geometry="geodesic-mix", rho=0.3, n_iters=5)
    b = adapters.sharpness(half, batches, geometry="geodesic-mix", rho=0.3, n_iters=5)
    assert math.isclose(b.value, a.value, rel_tol=1e-4), (a.value, b.value)
    assert all(torch.equal(p, before[n]) and p.dtype == dtype for n, p in half.named_parameters())


def test_device_memory_on_cuda_and_the_worst_gradient_kept_where_it_fits(monkeypatch):
    """The CUDA reading (the driver's free memory and torch's allocator) is consistent; a small
    run keeps the worst point's gradient (no recomputation at restarts), and one on a device read
    as nearly full recomputes it, with the same values either way."""
    from quotient_manifolds.adapters import memory, solver
    from quotient_manifolds.adapters.components import ProductBall
    from quotient_manifolds.adapters.elementwise import ElementwiseComponent
    from quotient_manifolds.adapters.solver import auto_pgd

    x = torch.empty(1000, device=CUDA)
    now = memory.device_memory(CUDA)
    assert 0 < now.available <= now.total and 4000 <= now.in_use <= now.peak
    del x
    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(300, 50, generator=gen, dtype=F64).to(CUDA)}

    def run():
        comp = ElementwiseComponent(tensors)
        return auto_pgd(ProductBall([comp]), lambda p: torch.tanh(3 * p[0]).sum(), 0.3, n_iters=20)

    kept = run()
    monkeypatch.setattr(solver, "device_memory", lambda device: memory.DeviceMemory(
        available=0, total=now.total, in_use=now.in_use, peak=now.in_use))
    lean = run()
    assert kept.history == lean.history and kept.n_forward < lean.n_forward


# ------------------------------------------------------------------------------------ Hessian, SAM
@pytest.mark.parametrize("geometry", ["geodesic-inv", "geodesic-mix", "adaptive"])
def test_riemannian_hessian_matches_cpu(plain_vit, geometry):
    pytest.importorskip("curvlinops")   # imported here: without it the other CUDA tests still run
    from quotient_manifolds.adapters.hessian import riemannian_hessian, top_eigenvalues

    model, x = plain_vit
    cpu, gpu = on_both(model)
    y = torch.tensor([1, 2])

    op_c = riemannian_hessian(cpu, [(x.to(F64), y)], geometry=geometry)
    op_g = riemannian_hessian(gpu, [(x.to(F64).to(CUDA), y.to(CUDA))], geometry=geometry)
    v = torch.randn(op_c.shape[0], generator=torch.Generator().manual_seed(3), dtype=F64)
    assert rel(op_g @ v.to(CUDA), op_c @ v) < 1e-9
    lam_c, lam_g = top_eigenvalues(op_c, 1)[0], top_eigenvalues(op_g, 1)[0]
    assert math.isclose(float(lam_g), float(lam_c), rel_tol=1e-6)


@pytest.mark.parametrize("geometry", ["geodesic-mix", "geodesic-inv", "adaptive", "sam"])
def test_geodesic_sam_steps_match_cpu(tiny_bert, geometry):
    model, inputs = tiny_bert
    cpu, gpu = on_both(model)
    labels = torch.tensor([1, 0])
    for m in (cpu, gpu):  # eval mode: no dropout, whose masks differ between the devices
        dev = next(m.parameters()).device
        batch = ({k: v.to(dev) for k, v in inputs.items()}, labels.to(dev))
        opt = GeodesicSAM(m, torch.optim.SGD, rho=0.1, geometry=geometry, lr=0.1)
        for _ in range(3):
            def closure():
                opt.zero_grad()
                loss = F.cross_entropy(m(**batch[0]).logits, batch[1])
                loss.backward()
                return loss
            opt.step(closure)
    # absolute floor: the key biases get a gradient that is zero in exact arithmetic (softmax is
    # blind to them), so both devices carry rounding noise of ~1e-17 there, not the same noise
    for (n, a), (_, b) in zip(cpu.named_parameters(), gpu.named_parameters()):
        assert b.device.type == CUDA.type, n
        torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=1e-9, atol=1e-12, msg=n)


def test_invariant_lora_training_matches_cpu():
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from quotient_manifolds.adapters import InvariantRiemannianSGD, lora_quotient_parameters

    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=16, num_labels=2)
    torch.manual_seed(0)
    base = transformers.BertForSequenceClassification(cfg).to(F64)
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["query", "value"],
                                                      init_lora_weights="gaussian",
                                                      task_type="SEQ_CLS"))
    with torch.no_grad():  # B ≠ 0: a point of the quotient (peft starts at B = 0)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(4))
    ids = torch.randint(0, 50, (4, 6), generator=torch.Generator().manual_seed(5))
    y = torch.tensor([0, 1, 1, 0])
    results = []
    for device in ("cpu", CUDA):
        m = copy.deepcopy(model).to(device).eval()  # no dropout (device-dependent masks)
        opt = InvariantRiemannianSGD(lora_quotient_parameters(m), lr=0.5, momentum=0.9)
        for _ in range(3):
            opt.zero_grad()
            F.cross_entropy(m(input_ids=ids.to(device)).logits, y.to(device)).backward()
            opt.step()
        results.append({n: p.detach() for n, p in m.named_parameters() if p.requires_grad})
    assert results[0].keys() == results[1].keys()
    for n in results[0]:
        assert results[1][n].device.type == CUDA.type and rel(results[1][n], results[0][n]) < 1e-9, n


# ------------------------------------------------------------------------------------ the studies
@pytest.mark.parametrize("study", ["vision", "text"])
def test_population_study_on_cuda_and_its_checkpoints_on_the_cpu(study, tmp_path, capsys):
    """``--device cuda`` trains and measures on the GPU (recorded in the configuration); the same
    study on the CPU from the GPU's checkpoints reuses every one of them and gives the same
    evaluation."""
    from quotient_manifolds.experiments.cli import main

    if study == "vision":  # its curvature measures need curvlinops
        pytest.importorskip("curvlinops")
    args = [study, "--quick", "--synthetic", "--no-progress", "--models", "2", "--n-boot", "50"]
    gpu_out, cpu_out = tmp_path / "gpu", tmp_path / "cpu"
    assert main(args + ["--device", "cuda", "--out", str(gpu_out)]) == 0
    assert main(args + ["--out", str(cpu_out), "--checkpoint-dir",
                        str(gpu_out / "checkpoints")]) == 0
    capsys.readouterr()
    gpu_recs, cpu_recs = (sorted((json.loads(line) for line in
                                  (d / "results.jsonl").read_text().splitlines()),
                                 key=lambda r: r["model_id"]) for d in (gpu_out, cpu_out))
    assert len(gpu_recs) == len(cpu_recs) == 2
    for g, c in zip(gpu_recs, cpu_recs):
        assert g["study_config"]["device"] == "cuda" and "device" not in c["study_config"]
        # the vision study's calibration pilot trains its first models, which the main pass then
        # reuses; the CPU run must reuse every one of the GPU's checkpoints
        assert c["reused_checkpoint"] and (study == "vision" or not g["reused_checkpoint"])
        assert all(math.isfinite(s["value"]) for s in g["sharpness"] if "error" not in s)
        # float32 on both devices, and cuDNN runs the ViT's patch convolution in TF32 by default
        for key in ("train_loss", "test_loss"):
            assert math.isclose(g["metrics"][key], c["metrics"][key], rel_tol=2e-2), key
