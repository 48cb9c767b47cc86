"""Training with fx2xla matches eager PyTorch: loss trajectories, gradients and parameters
after compiled forward/backward and compiled optimizer steps (SGD with momentum, Adam, AdamW;
foreach, single-tensor and fused), whole compiled train steps, a full-graph functional step,
autocast, dropout, gradient accumulation, train/eval switching, `transformers.Trainer` and a
spatial transformer network (grid sampling and its gradients).

Every comparison runs the same model twice from identical copies (same seed, same inputs):
once eagerly, once compiled with fx2xla. Dropout is switched off in the transformer models
(p=0) wherever values are compared: fx2xla's random bits differ from eager's by design
(docs/usage.md: "Random ops"); dropout itself is checked statistically.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import fx2xla
from fx2xla.testing import LogitsOnly, bert, gpt2, llama, mlp, token_ids

# Tolerances per dtype for every comparison with eager in this file (assert_close kwargs).
# "step": one forward + backward (losses, gradients). "trajectory": losses and parameters
# after several optimizer steps, where XLA's reordered float math compounds (measured worst
# case on these models: 5e-5 absolute on parameters after 20 AdamW steps at lr 1e-3).
# bfloat16 is autocast: matmuls in bf16 with f32 accumulation, rounded differently by XLA's
# fusions than by eager's kernels.
TOL = {
    torch.float32: {
        "step": dict(rtol=1e-4, atol=1e-5),
        "trajectory": dict(rtol=1e-3, atol=1e-4),
    },
    torch.bfloat16: {
        "step": dict(rtol=5e-2, atol=2e-2),
    },
}
# Adam's step lr * m / (sqrt(v) + eps) follows the sign of the gradient even where the gradient
# is rounding noise: an element whose true gradient is ~1e-8 (below eager's own float32 error
# w.r.t. float64, ~4e-8 on LLaMA's embedding) can step +lr in eager and -lr in fx2xla. Such
# isolated elements may differ by up to 2 * lr per step taken, in at most this fraction of a
# tensor (at least one element); every other element must meet "trajectory".
ADAM_SIGN_FLIP_FRACTION = 1e-3


def assert_close(actual, expected, dtype=torch.float32, kind="step", msg=""):
    torch.testing.assert_close(actual, expected, **TOL[dtype][kind], msg=lambda m: f"{msg}: {m}" if msg else m)


# --------------------------------------------------------------------------------------------
# Models and data: small configs (2 layers, hidden 64, 4 heads, seq 32, batch 2, vocab 256).
# --------------------------------------------------------------------------------------------
VOCAB, BATCH, SEQ = 256, 2, 32
TRANSFORMER = dict(layers=2, hidden=64, heads=4, vocab=VOCAB, positions=64)


def _no_dropout(model: torch.nn.Module) -> torch.nn.Module:
    # transformers reads the attention dropout probability from these modules too.
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


def build(name: str) -> torch.nn.Module:
    """The model `name` with seeded random weights, dropout off, in training mode."""
    torch.manual_seed(0)
    if name == "mlp":
        model = mlp(32, 64, 16)
    elif name == "gpt2":
        model = LogitsOnly(gpt2(**TRANSFORMER))
    elif name == "bert":
        model = LogitsOnly(bert(**TRANSFORMER))
    elif name == "llama":
        model = LogitsOnly(llama(kv_heads=2, **TRANSFORMER))
    else:
        raise ValueError(name)
    return _no_dropout(model).train()


def batches(name: str, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n` different (input, target) batches of one shape. Targets are class indices into the
    model's last dimension (next-token ids for the language models; BertModel's hidden size
    doubles as 64 classes)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        if name == "mlp":
            out.append((torch.randn(8, 32, generator=g), torch.randint(0, 16, (8,), generator=g)))
        else:
            ids = token_ids(BATCH, SEQ, VOCAB, seed=100 + i)
            classes = 64 if name == "bert" else VOCAB
            out.append((ids, ids.roll(-1, dims=1) % classes))
    return out


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), target.reshape(-1))


ADAM_LR = 1e-3


def _impl(foreach) -> dict:
    """Optimizer implementation: foreach True (multi-tensor `_foreach_*` ops), False (single
    tensor), None (torch's default) or "fused" (one `_fused_*` kernel; SGD, Adam, AdamW only)."""
    return {"fused": True} if foreach == "fused" else {"foreach": foreach}


OPTIMIZERS = {
    "sgd": lambda params, foreach: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4, **_impl(foreach)),
    "adam": lambda params, foreach: torch.optim.Adam(params, lr=ADAM_LR, **_impl(foreach)),
    "adamw": lambda params, foreach: torch.optim.AdamW(params, lr=ADAM_LR, weight_decay=0.01, **_impl(foreach)),
}


def sign_flip_bound(optimizer: str, steps: int) -> float:
    return 2 * ADAM_LR * steps if optimizer in ("adam", "adamw") else 0.0


def compile_fx2xla(fn, **kwargs):
    return torch.compile(fn, backend="fx2xla", **kwargs)


class GraphCount:
    """How many graphs fx2xla compiled inside the `with` block: a test that silently ran
    eagerly (a Dynamo skip, a wrong backend) would otherwise pass every comparison."""

    def __enter__(self):
        self.start = fx2xla.metrics()["graphs"]
        return self

    def __exit__(self, *exc):
        self.graphs = fx2xla.metrics()["graphs"] - self.start


def assert_same_params(actual: torch.nn.Module, expected: torch.nn.Module, kind="trajectory",
                       dtype=torch.float32, flip_bound: float = 0.0):
    """Parameters match; with `flip_bound` > 0 (Adam), a few isolated elements may differ by
    up to that much (see ADAM_SIGN_FLIP_FRACTION)."""
    for (name, a), (_, e) in zip(actual.named_parameters(), expected.named_parameters()):
        a, e = a.detach(), e.detach()
        if flip_bound > 0:
            tol = TOL[dtype][kind]
            diff = (a - e).abs()
            outside = diff > tol["atol"] + tol["rtol"] * e.abs()
            allowed = max(1, int(ADAM_SIGN_FLIP_FRACTION * e.numel()))
            if 0 < int(outside.sum()) <= allowed and float(diff.max()) <= flip_bound:
                a = torch.where(outside, e, a)  # the flipped elements are within bounds
        assert_close(a, e, dtype, kind, msg=f"parameter {name}")


def assert_same_grads(actual: torch.nn.Module, expected: torch.nn.Module, kind="step", dtype=torch.float32):
    for (name, a), (_, e) in zip(actual.named_parameters(), expected.named_parameters()):
        assert (a.grad is None) == (e.grad is None), f"{name}: grad is None: fx2xla {a.grad is None}, eager {e.grad is None}"
        if e.grad is not None:
            assert_close(a.grad, e.grad, dtype, kind, msg=f"grad of {name}")


# --------------------------------------------------------------------------------------------
# 1. Multi-step trajectories: compiled model + compiled optimizer step vs eager.
# --------------------------------------------------------------------------------------------
def train(model, optimizer, data, steps: int, compiled: bool) -> torch.Tensor:
    """`steps` steps of forward, backward, optimizer step, zero_grad; returns the losses."""
    opt = OPTIMIZERS[optimizer[0]](model.parameters(), optimizer[1])
    forward = compile_fx2xla(model) if compiled else model
    # fallback="error": every op of the step (the foreach ops too) must lower to XLA.
    step = compile_fx2xla(opt.step, options={"fallback": "error"}) if compiled else opt.step
    losses = []
    for i in range(steps):
        x, y = data[i % len(data)]
        loss = loss_fn(forward(x), y)
        loss.backward()
        step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


# Each model and each optimizer, foreach and single-tensor, within the time budget: all six
# optimizer variants on the MLP for 20 steps; 20 steps on GPT-2; 5 steps elsewhere.
TRAJECTORIES = [
    ("mlp", "sgd", True, 20),
    ("mlp", "sgd", False, 20),
    ("mlp", "adam", True, 20),
    ("mlp", "adam", False, 20),
    ("mlp", "adamw", True, 20),
    ("mlp", "adamw", False, 20),
    ("gpt2", "adamw", True, 20),
    ("gpt2", "sgd", False, 5),
    ("bert", "adam", True, 5),
    ("llama", "adamw", False, 5),
]


@pytest.mark.parametrize(
    "name,optimizer,foreach,steps", TRAJECTORIES,
    ids=[f"{m}-{o}-{'foreach' if f else 'single'}-{s}steps" for m, o, f, s in TRAJECTORIES],
)
def test_trajectory_matches_eager(name, optimizer, foreach, steps):
    model = build(name)
    reference = copy.deepcopy(model)
    data = batches(name, 3)
    with GraphCount() as count:
        losses = train(model, (optimizer, foreach), data, steps, compiled=True)
    expected = train(reference, (optimizer, foreach), data, steps, compiled=False)
    # forward + backward of the model, and the optimizer step (whose graph has no backward)
    assert count.graphs >= 3, f"fx2xla compiled only {count.graphs} graphs"
    assert_close(losses, expected, kind="trajectory", msg="losses")
    assert_same_params(model, reference, flip_bound=sign_flip_bound(optimizer, steps))
    if steps >= 20:
        assert expected[-3:].mean() < expected[:3].mean(), "eager did not learn: the comparison is vacuous"


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_fused_optimizer_trajectory(optimizer):
    """fused=True matches eager, but its kernel is not compiled: Dynamo does not trace into
    torch.optim's `_fused_adam`/`_fused_adamw` (torch.compiler.disable, "don't trace into fused
    optimizer") and runs them eagerly, so fx2xla compiles the model's forward and backward
    only; foreach=True puts the update in XLA."""
    model = build("mlp")
    reference = copy.deepcopy(model)
    data = batches("mlp", 3)
    with GraphCount() as count:
        losses = train(model, (optimizer, "fused"), data, 10, compiled=True)
    expected = train(reference, (optimizer, "fused"), data, 10, compiled=False)
    assert count.graphs == 2, f"fx2xla compiled {count.graphs} graphs; expected forward + backward only"
    assert_close(losses, expected, kind="trajectory", msg="losses")
    assert_same_params(model, reference, flip_bound=sign_flip_bound(optimizer, 10))


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "single"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_optimizer_step_lowers_without_fallback(optimizer, foreach):
    """The optimizer step is one XLA graph: no op of it runs eagerly between XLA subgraphs
    (the trajectories above stay right either way; this is about the step being compiled)."""

    model = build("mlp")
    reference = copy.deepcopy(model)
    (x, y), = batches("mlp", 1)
    for m in (model, reference):
        loss_fn(m(x), y).backward()
    opt = OPTIMIZERS[optimizer](model.parameters(), foreach)
    ref_opt = OPTIMIZERS[optimizer](reference.parameters(), foreach)
    with GraphCount() as count:
        torch.compile(opt.step, backend="fx2xla", options={"fallback": "error"})()
    ref_opt.step()
    assert count.graphs == 1
    assert_same_params(model, reference, kind="step")


# --------------------------------------------------------------------------------------------
# 2. Gradients after one step, including parameters whose gradient stays None.
# --------------------------------------------------------------------------------------------
class WithUnused(torch.nn.Module):
    """An MLP with an unused submodule, an unused parameter and a frozen parameter: their
    .grad must stay None, and the optimizer must leave them alone."""

    def __init__(self):
        super().__init__()
        self.body = mlp(32, 64, 16)
        self.unused_layer = torch.nn.Linear(16, 16)
        self.unused = torch.nn.Parameter(torch.randn(5))
        self.frozen_scale = torch.nn.Parameter(torch.full((16,), 1.5), requires_grad=False)

    def forward(self, x):
        return self.body(x) * self.frozen_scale


@pytest.mark.parametrize("name", ["mlp_unused", "gpt2", "bert", "llama"])
def test_gradients_after_one_step(name):
    if name == "mlp_unused":
        torch.manual_seed(0)
        model = WithUnused()
        data = batches("mlp", 1)
    else:
        model = build(name)
        data = batches(name, 1)
    reference = copy.deepcopy(model)
    (x, y), = data
    with GraphCount() as count:
        loss = loss_fn(compile_fx2xla(model)(x), y)
        loss.backward()
    assert count.graphs >= 2
    expected = loss_fn(reference(x), y)
    expected.backward()
    assert_close(loss, expected, msg="loss")
    assert_same_grads(model, reference)
    if name == "mlp_unused":
        assert model.unused.grad is None and model.unused_layer.weight.grad is None
        assert model.frozen_scale.grad is None
        # The compiled optimizer step skips parameters without gradients, as eager's does.
        before = copy.deepcopy(model)
        opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, reference))
        compile_fx2xla(opt.step)()
        ref_opt.step()
        assert_same_params(model, reference, kind="step")
        torch.testing.assert_close(model.unused, before.unused, rtol=0, atol=0)
        torch.testing.assert_close(model.unused_layer.weight, before.unused_layer.weight, rtol=0, atol=0)
        assert not torch.equal(model.body[0].weight, before.body[0].weight)


# --------------------------------------------------------------------------------------------
# 3. One compiled function for the whole step: forward, backward, optimizer step, zero_grad.
# --------------------------------------------------------------------------------------------
def make_train_step(model, opt):
    def train_step(x, y):
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return train_step


@pytest.mark.parametrize("name,steps", [("mlp", 10), ("llama", 5)])
def test_compiled_train_step_function(name, steps):
    model = build(name)
    reference = copy.deepcopy(model)
    data = batches(name, 3)
    opt = OPTIMIZERS["adamw"](model.parameters(), None)
    ref_opt = OPTIMIZERS["adamw"](reference.parameters(), None)
    step = compile_fx2xla(make_train_step(model, opt))
    ref_step = make_train_step(reference, ref_opt)
    with GraphCount() as count:
        losses = torch.stack([step(*data[i % 3]) for i in range(steps)])
    expected = torch.stack([ref_step(*data[i % 3]) for i in range(steps)])
    assert count.graphs >= 3
    assert_close(losses, expected, kind="trajectory", msg="losses")
    assert_same_params(model, reference, flip_bound=sign_flip_bound("adamw", steps))
    assert all(p.grad is None for p in model.parameters()), "zero_grad() inside the compiled step"


# --------------------------------------------------------------------------------------------
# 4. A full-graph functional step: torch.func.grad_and_value + functional_call + SGD update.
# --------------------------------------------------------------------------------------------
def functional_step(model, lr):
    def loss_of(params, buffers, x, y):
        return loss_fn(torch.func.functional_call(model, (params, buffers), (x,)), y)

    def step(params, buffers, x, y):
        grads, loss = torch.func.grad_and_value(loss_of)(params, buffers, x, y)
        return {k: p - lr * grads[k] for k, p in params.items()}, loss

    return step


@pytest.mark.parametrize("name,steps", [("mlp", 5), ("gpt2", 3)])
def test_functional_step_fullgraph(name, steps):
    model = build(name)
    data = batches(name, 3)
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}
    eager = functional_step(model, lr=0.1)
    compiled = compile_fx2xla(eager, fullgraph=True)
    p_eager, p_compiled = dict(params), dict(params)
    with GraphCount() as count:
        for i in range(steps):
            x, y = data[i % 3]
            p_compiled, loss = compiled(p_compiled, buffers, x, y)
            p_eager, expected = eager(p_eager, buffers, x, y)
            assert_close(loss, expected, kind="trajectory", msg=f"loss at step {i}")
    assert count.graphs >= 1
    for k in params:
        assert_close(p_compiled[k], p_eager[k], kind="trajectory", msg=k)
    assert not torch.equal(p_compiled[k], params[k])


# --------------------------------------------------------------------------------------------
# 5. Autocast, dropout, gradient accumulation, train/eval switching.
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mlp", "gpt2"])
def test_autocast_bf16_forward_backward(name):
    model = build(name)
    reference = copy.deepcopy(model)
    (x, y), = batches(name, 1)
    compiled = compile_fx2xla(model)
    with GraphCount() as count:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = compiled(x)
            loss = loss_fn(out, y)
        loss.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_out = reference(x)
        expected = loss_fn(ref_out, y)
    expected.backward()
    assert count.graphs >= 2
    assert out.dtype == ref_out.dtype == torch.bfloat16
    assert_close(out, ref_out, torch.bfloat16, msg="output")
    assert_close(loss, expected, torch.bfloat16, msg="loss")
    for (n, p), (_, r) in zip(model.named_parameters(), reference.named_parameters()):
        assert p.grad.dtype == r.grad.dtype == torch.float32
        # Compare gradients relative to the tensor's scale: bf16 errors scale with it.
        scale = r.grad.abs().max().clamp_min(1e-6)
        assert_close(p.grad / scale, r.grad / scale, torch.bfloat16, msg=f"grad of {n}")


class Dropped(torch.nn.Module):
    def __init__(self, p):
        super().__init__()
        self.dropout = torch.nn.Dropout(p)

    def forward(self, x):
        return self.dropout(x) * 3.0


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_statistics_and_gradient(p):
    torch.manual_seed(0)
    x = (torch.rand(256, 256) + 0.5).requires_grad_()  # no zeros of its own
    compiled = compile_fx2xla(Dropped(p).train())
    out = compiled(x)
    out.backward(torch.ones_like(out))
    kept = out != 0
    n = x.numel()
    dropped = 1 - kept.float().mean().item()
    # Binomial(n, p): 6 standard deviations.
    assert abs(dropped - p) < 6 * math.sqrt(p * (1 - p) / n), (dropped, p)
    scale = 3.0 / (1 - p)
    torch.testing.assert_close(out[kept], x.detach()[kept] * scale)
    # The gradient flows only through kept units, scaled by the same 1/(1-p).
    torch.testing.assert_close(x.grad, kept.float() * scale)
    # A second call draws a fresh mask; torch.manual_seed makes the draw repeatable.
    assert not torch.equal(compiled(x) != 0, kept)
    torch.manual_seed(123)
    a = compiled(x)
    torch.manual_seed(123)
    torch.testing.assert_close(compiled(x), a, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["mlp", "bert"])
def test_gradient_accumulation(name):
    model = build(name)
    reference = copy.deepcopy(model)
    data = batches(name, 6)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    forward, step = compile_fx2xla(model), compile_fx2xla(opt.step)
    for start in (0, 3):  # two optimizer steps of 3 micro-batches each
        for x, y in data[start:start + 3]:
            (loss_fn(forward(x), y) / 3).backward()
            (loss_fn(reference(x), y) / 3).backward()
        assert_same_grads(model, reference)
        step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    assert_same_params(model, reference)


class BatchNormHead(torch.nn.Module):
    """Batch norm (batch statistics and running-stat updates in train mode, running stats
    in eval) followed by dropout as the last op, so a train-mode output is either 0 or the
    dropout-free output / (1 - p)."""

    def __init__(self, p=0.5):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(),
                                        torch.nn.Linear(64, 16))
        self.dropout = torch.nn.Dropout(p)

    def forward(self, x):
        return self.dropout(self.body(x))


def test_train_eval_switching():
    torch.manual_seed(0)
    p = 0.5
    model = BatchNormHead(p)
    reference = copy.deepcopy(model)
    reference.dropout.p = 0.0  # eager's train-mode output without the (random) mask
    compiled = compile_fx2xla(model)
    g = torch.Generator().manual_seed(2)
    for mode in ["train", "eval", "train", "train", "eval"]:
        model.train(mode == "train")
        reference.train(mode == "train")
        x = torch.randn(64, 32, generator=g) * 2 + 1
        out = compiled(x)
        expected = reference(x)
        if mode == "eval":
            assert_close(out, expected, msg="eval output")
            assert (out != 0).float().mean() > 0.9, "dropout must be off in eval mode"
        else:
            kept = out != 0
            assert 0.4 < 1 - kept.float().mean() < 0.6
            assert_close(out[kept], expected[kept] / (1 - p), msg="train output (kept units)")
        # Running statistics are updated in train mode only, as eager's.
        bn, ref_bn = model.body[1], reference.body[1]
        assert_close(bn.running_mean, ref_bn.running_mean, msg=f"running_mean after {mode}")
        assert_close(bn.running_var, ref_bn.running_var, msg=f"running_var after {mode}")
        assert bn.num_batches_tracked == ref_bn.num_batches_tracked


# --------------------------------------------------------------------------------------------
# 6. transformers.Trainer.
# --------------------------------------------------------------------------------------------
class RepeatingTokens(torch.utils.data.Dataset):
    """Sequences repeating a 4-token pattern: a small GPT-2 learns them in a few steps."""

    def __init__(self, n=32, seq=16, vocab=64):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, 4), generator=g).repeat(1, seq // 4)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer_losses(tmp_path, monkeypatch, model, **compile_args):
    import transformers

    # TrainingArguments exports ACCELERATE_DYNAMO_BACKEND; keep it out of later tests.
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "NO")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=12, per_device_train_batch_size=8,
        learning_rate=3e-3, logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0,
        dataloader_num_workers=0, **compile_args,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=RepeatingTokens())
    result = trainer.train()
    assert result.global_step == 12
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _tiny_gpt2():
    # Dropout off: with it, XLA's compile of the forward graph takes several times longer
    # (jax's threefry PRNG); dropout in training is tested above.
    torch.manual_seed(0)
    return _no_dropout(gpt2(layers=1, hidden=32, heads=2, vocab=64, positions=16))


def _assert_learns(losses):
    assert len(losses) == 12 and all(math.isfinite(v) for v in losses), losses
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses


@pytest.mark.xfail(raises=ValueError, strict=True,
                   reason="accelerate's TorchDynamoPlugin accepts only its DynamoBackend enum "
                          "(inductor, eager, ...), so Trainer cannot pass a third-party backend name")
def test_trainer_torch_compile_backend(tmp_path, monkeypatch):
    with GraphCount() as count:
        losses = _trainer_losses(tmp_path, monkeypatch, _tiny_gpt2(),
                                 torch_compile=True, torch_compile_backend="fx2xla")
    assert count.graphs >= 2
    _assert_learns(losses)


def test_trainer_with_fx2xla_compiled_model(tmp_path, monkeypatch):
    """What works today: compile the model in place with fx2xla, hand it to Trainer."""
    model = _tiny_gpt2()
    model.compile(backend="fx2xla")
    with GraphCount() as count:
        losses = _trainer_losses(tmp_path, monkeypatch, model)
    assert count.graphs >= 2, "Trainer did not run the fx2xla-compiled model"
    _assert_learns(losses)


class _SpatialTransformer(torch.nn.Module):
    """A spatial transformer network (Jaderberg et al.): a localization net predicts an affine
    transform, F.affine_grid / F.grid_sample warp the image with it, a small classifier reads
    the warped image. Trains the grid sampler's gradients for the input and the grid."""

    def __init__(self, mode: str, padding_mode: str):
        super().__init__()
        self.mode, self.padding_mode = mode, padding_mode
        self.loc = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(4),
                                       torch.nn.Flatten(), torch.nn.Linear(64, 6))
        with torch.no_grad():  # start near the identity, as STNs are initialised
            self.loc[-1].weight.mul_(0.1)
            self.loc[-1].bias.copy_(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0]))
        self.head = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                                        torch.nn.Linear(4 * 12 * 12, 5))

    def forward(self, x):
        theta = self.loc(x).view(-1, 2, 3)
        grid = F.affine_grid(theta, (x.shape[0], 1, 12, 12), align_corners=False)
        return self.head(F.grid_sample(x, grid, mode=self.mode, padding_mode=self.padding_mode, align_corners=False))


@pytest.mark.parametrize("mode,padding_mode", [("bilinear", "zeros"), ("bicubic", "reflection"),
                                               ("bilinear", "border")])
def test_spatial_transformer_training_matches_eager(mode, padding_mode):
    """Four SGD-with-momentum steps of a spatial transformer network, compiled with
    fallback="error" (the grid sampler and its backward lower): losses and parameters after
    every step match eager's at the "trajectory" tolerance (float32)."""
    torch.manual_seed(0)
    model = _SpatialTransformer(mode, padding_mode)
    twin = copy.deepcopy(model)
    x, y = torch.randn(4, 1, 16, 16), torch.tensor([0, 3, 1, 4])
    step = torch.compile(lambda m, x: F.cross_entropy(m(x), y), backend="fx2xla", options={"fallback": "error"})
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, twin)]
    for i in range(4):
        losses = []
        for m, opt, fn in ((model, opts[0], step), (twin, opts[1], lambda m, x: F.cross_entropy(m(x), y))):
            opt.zero_grad()
            loss = fn(m, x)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        assert_close(losses[0], losses[1], kind="trajectory", msg=f"loss at step {i}")
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert_close(p, q, kind="trajectory", msg=f"{name} after step {i}")
