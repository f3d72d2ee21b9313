"""A layout belongs to the model it was built for, and inputs that cannot work are refused where they
enter, naming what is wrong: another model's layout (same parameter names but other head counts, or
other parameters), heads larger than their factors, a model on the meta device, wrong-shaped token
ids, a batch size of 0. The user's model is left bit-identical by every refused call."""
from __future__ import annotations

import copy

import pytest
import torch

from quotient_manifolds import adapters
from quotient_manifolds.adapters.derive import derive_groups
from quotient_manifolds.adapters.worst_case import sharpness, sharpness_sweep
from quotient_manifolds.errors import InvalidArgument, InvalidArgumentType, UnsupportedModel

T = pytest.importorskip("transformers")


def tiny_bert(heads: int, hidden: int = 8, device=None) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = T.BertConfig(vocab_size=50, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=heads,
                       intermediate_size=16, max_position_embeddings=16, num_labels=2)
    if device is None:      # float64: invariance checks at a tolerance far from rounding
        return T.BertForSequenceClassification(cfg).double().eval()
    with torch.device(device):
        return T.BertForSequenceClassification(cfg).double().eval()


IDS = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(0))
LABELS = torch.tensor([0, 1])
BATCHES = [({"input_ids": IDS}, LABELS)]


def snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def unchanged(model, snap) -> bool:
    now = model.state_dict()
    return now.keys() == snap.keys() and all(torch.equal(now[k], v) for k, v in snap.items())


def _distributed(model, layout, monkeypatch):
    # the layout is resolved before any collective call, so one process stands for every rank
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    return adapters.distributed_sharpness(model, BATCHES, rho=0.1, n_iters=2, layout=layout)


def _sam(model, layout, monkeypatch):
    return adapters.GeodesicSAM(model, torch.optim.SGD, layout=layout, lr=0.1)


def _hessian(model, layout, monkeypatch):
    from quotient_manifolds.adapters.hessian import riemannian_hessian

    pytest.importorskip("curvlinops")
    return riemannian_hessian(model, BATCHES, layout=layout)


ENTRY_POINTS = {
    "sharpness": lambda m, lay, mp: sharpness(m, BATCHES, rho=0.1, n_iters=2, layout=lay),
    "sharpness_sweep": lambda m, lay, mp: sharpness_sweep(m, BATCHES, [0.1, 0.2], n_iters=2, layout=lay),
    "verify": lambda m, lay, mp: lay.verify(m, {"input_ids": IDS}),
    "derive_groups": lambda m, lay, mp: derive_groups(m, lay, {"input_ids": IDS}),
    "GeodesicSAM": _sam,
    "riemannian_hessian": _hessian,
    "distributed_sharpness": _distributed,
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_a_layout_of_another_head_count_is_refused_naming_the_block(entry, monkeypatch):
    """4 heads of 2 and 2 heads of 4 have the same weight shapes; the 4-head layout acts with
    GL(2)x GL(2) inside each GL(4) head of the 2-head model: it passes verify, yet its geodesic
    sharpness is not invariant under the 2-head model's symmetry. It must not run."""
    lay4, model = adapters.layout(tiny_bert(4)), tiny_bert(2)
    snap = snapshot(model)
    with pytest.raises(InvalidArgument, match=r"block bert\.encoder\.layer\.0\.attention: built for 4 heads, "
                                         r"this model has 2 heads \(self\.num_attention_heads"):
        ENTRY_POINTS[entry](model, lay4, monkeypatch)
    assert unchanged(model, snap)


@pytest.mark.parametrize("entry", ["sharpness", "verify", "riemannian_hessian"])
def test_a_layout_of_another_architecture_names_the_missing_parameter(entry, monkeypatch):
    torch.manual_seed(0)
    vit = T.ViTForImageClassification(T.ViTConfig(image_size=8, patch_size=4, num_channels=1, hidden_size=8,
                                                  num_hidden_layers=1, num_attention_heads=2,
                                                  intermediate_size=16))
    model = tiny_bert(2)
    snap = snapshot(model)
    with pytest.raises(InvalidArgument, match=r"parameter 'vit\.layers\.0\.attention\.q_proj\.weight' \(used by "
                                         r"block vit\.layers\.0\.attention/qk\) is missing from this model"):
        ENTRY_POINTS[entry](model, adapters.layout(vit), monkeypatch)
    assert unchanged(model, snap)


def test_a_layout_of_another_width_names_the_shapes():
    model = tiny_bert(2, hidden=16)
    with pytest.raises(InvalidArgument, match=r"built for shape \(50, 8\), this model has \(50, 16\)"):
        sharpness(model, BATCHES, rho=0.1, n_iters=2, layout=adapters.layout(tiny_bert(2)))


def test_a_layout_fits_its_model_a_copy_and_a_retrained_twin():
    """Identity is structure, not values: the same architecture with other weights is accepted."""
    model = tiny_bert(2)
    lay = adapters.layout(model)
    assert lay.head_structure["bert.encoder.layer.0.attention"]["self.num_attention_heads"] == 2
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(0.01)
    for m in (model, twin):
        lay.check_model(m)
        assert lay.verify(m, {"input_ids": IDS}).passed


def test_a_declared_layout_and_a_hand_built_one_keep_working():
    model = tiny_bert(2)
    path = "bert.encoder.layer.0.attention"
    blocks = [adapters.declare_block(model, q=f"{path}.self.query", k=f"{path}.self.key", num_heads=2),
              adapters.declare_block(model, v=f"{path}.self.value", o=f"{path}.output.dense", num_heads=2)]
    declared = adapters.layout(model, blocks=blocks, detect_blocks=False)
    by_hand = adapters.Layout(blocks=declared.blocks, adaptive=declared.adaptive, gl_masks=declared.gl_masks,
                              frozen=[], unsupported=[])          # no identity recorded: names only
    for lay in (declared, by_hand):
        assert lay.verify(model, {"input_ids": IDS}).passed
    with pytest.raises(InvalidArgument, match="built for 2 heads, this model has 4 heads"):
        declared.verify(tiny_bert(4), {"input_ids": IDS})


# ------------------------------------------------------------- heads larger than their factors
def test_declare_block_refuses_a_head_larger_than_its_factors_naming_the_block():
    class Scores(torch.nn.Module):            # q, k: 2 input features -> 8: G and H are 3 x 8
        def __init__(self):
            super().__init__()
            self.q, self.k = torch.nn.Linear(2, 8), torch.nn.Linear(2, 8)

    with pytest.raises(InvalidArgument, match=r"block '/qk': head_dim 8 exceeds the rows of G \(3, 8\) or H \(3, 8\)"):
        adapters.declare_block(Scores(), q="q", k="k", num_heads=1)


def test_declare_block_names_the_block_when_heads_do_not_divide_the_projection():
    model = tiny_bert(2)
    path = "bert.encoder.layer.0.attention"
    with pytest.raises(InvalidArgument, match=rf"block '{path}\.self/qk': cannot infer head_dim: "
                                         rf"'{path}\.self\.query' gives 8 features"):
        adapters.declare_block(model, q=f"{path}.self.query", k=f"{path}.self.key", num_heads=3)
    with pytest.raises(InvalidArgument, match=rf"block '{path}/vo': '{path}\.self\.value' gives 8 features but "
                                         rf"1 heads x 16 need 16"):
        adapters.declare_block(model, v=f"{path}.self.value", o=f"{path}.output.dense", num_heads=1,
                               head_dim=16)
    with pytest.raises(InvalidArgument, match="num_heads must be an integer >= 1, got 0"):
        adapters.declare_block(model, q=f"{path}.self.query", k=f"{path}.self.key", num_heads=0)


def test_detection_reports_heads_larger_than_the_hidden_size_as_unsupported():
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=2, head_dim=16, intermediate_size=16)
    model = T.LlamaForCausalLM(cfg).eval()
    with pytest.raises(UnsupportedModel, match=r"model\.layers\.0\.self_attn/vo \[LlamaAttention\]: head_dim 16 "
                                         r"exceeds the rows of the VO factors per head \(G 8, H 8\)"):
        adapters.layout(model)
    lay = adapters.layout(model, allow_unsupported=True)
    assert not lay.blocks and len(lay.unsupported) == 2


def test_a_lora_rank_above_its_features_is_elementwise_with_a_note():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_bert(2), peft.LoraConfig(r=16, target_modules=["query"]))
    lay = adapters.layout(model, allow_unsupported=True)
    assert not any(b.kind == "lora" for b in lay.blocks)
    assert any("rank 16 above its input (8) or output (8) features" in note for note in lay.notes), lay.notes


# ------------------------------------------------------------------------------ meta device
@pytest.mark.parametrize("entry", ["sharpness", "riemannian_hessian", "GeodesicSAM", "verify"])
def test_a_meta_model_is_refused_with_how_to_materialise_it(entry, monkeypatch):
    model = tiny_bert(2, device="meta")
    lay = adapters.layout(model)                  # shapes are enough for a layout
    assert len(lay.blocks) == 2
    with pytest.raises(InvalidArgument, match=r"meta device .*model\.to_empty\(device='cpu'\).*load_state_dict"):
        ENTRY_POINTS[entry](model, lay, monkeypatch)


# ------------------------------------------------------------------------------ batches
@pytest.mark.parametrize("entry", ["sharpness", "riemannian_hessian"])
@pytest.mark.parametrize("ids,words", [
    (IDS[None], r"batch 1: input_ids has shape \(1, 2, 5\), but BertForSequenceClassification expects 2 "
                r"dimensions \(batch, sequence\); it has an extra leading dimension"),
    (IDS[0], r"batch 1: input_ids has shape \(5,\).*\.unsqueeze\(0\)"),
])
def test_wrong_shaped_token_ids_name_the_batch_and_the_shape(entry, ids, words):
    from quotient_manifolds.adapters.hessian import riemannian_hessian

    if entry == "riemannian_hessian":
        pytest.importorskip("curvlinops")
    model = tiny_bert(2)
    snap = snapshot(model)
    batches = [BATCHES[0], ({"input_ids": ids}, LABELS)]
    with pytest.raises(InvalidArgument, match=words):
        if entry == "sharpness":
            sharpness(model, batches, rho=0.1, n_iters=2, geometry="adaptive")
        else:
            riemannian_hessian(model, batches, geometry="adaptive")
    assert unchanged(model, snap)


def test_an_attention_mask_of_another_shape_than_the_ids_is_refused():
    mask = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(InvalidArgument, match=r"batch 0: attention_mask has shape \(2, 4\), but input_ids has shape \(2, 5\)"):
        sharpness(tiny_bert(2), [({"input_ids": IDS, "attention_mask": mask}, LABELS)], rho=0.1, n_iters=2)


@pytest.mark.parametrize("size,error", [(0, InvalidArgument), (-2, InvalidArgument), (1.5, InvalidArgumentType)])
def test_batch_size_fn_must_give_a_positive_integer(size, error):
    pytest.importorskip("curvlinops")
    from quotient_manifolds.adapters.hessian import riemannian_hessian

    with pytest.raises(error, match=r"batch_size_fn\(inputs\) of batch 0 must be an integer >= 1"):
        riemannian_hessian(tiny_bert(2), BATCHES, batch_size_fn=lambda inputs: size)
